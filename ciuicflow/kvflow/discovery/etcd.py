"""A thin asyncio client of etcd's v3 gRPC API: what discovery needs and nothing more (docs/discovery.md, Why
this client).

Range / Put / Delete of one prefix, a lease with its keep-alive stream, and a watch stream. grpcio speaks
etcd's API directly (the sidecar already runs on grpc.aio): methods are called by path with the messages of
``etcd.proto``, so no third-party etcd package and its protobuf pins come along. Everything etcd answers is
bounded by the channel's message limit; what a value *means* is checked by ``entry.py``.

``EtcdError`` reports what failed, for the caller to retry: losing etcd must not lose peers (registry.py).
"""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import AsyncIterator, List, Sequence, Tuple
from urllib.parse import urlsplit

import grpc

from . import etcd_pb2 as epb

log = logging.getLogger("ciuicflow.kvflow.discovery")

MAX_MESSAGE = 4 << 20           # the largest answer taken from etcd: more peers than the cap never fit anyway
CALL_TIMEOUT_S = 3.0            # a unary call to etcd (a put, a range)
_PREFIX_RE = re.compile(r"^/?[A-Za-z0-9._/-]{1,128}$")

_KV, _WATCH, _LEASE = "/etcdserverpb.KV/", "/etcdserverpb.Watch/", "/etcdserverpb.Lease/"


class EtcdError(Exception):
    """A call to etcd failed (unreachable, timed out, refused)."""


@dataclass(frozen=True)
class EtcdTarget:
    """Where the registry lives: etcd endpoints (HOST:PORT, tried in turn) and the key prefix."""
    endpoints: Tuple[str, ...]
    prefix: str

    @property
    def key_prefix(self) -> bytes:
        return (self.prefix.rstrip("/") + "/").encode()


def parse_target(url: str) -> EtcdTarget:
    """``etcd://HOST:PORT[,HOST:PORT...]/PREFIX`` (plain gRPC to etcd; the registry grants no trust, so
    etcd's own transport security is the operator's to add in front of it)."""
    parts = urlsplit(str(url).strip())
    if parts.scheme != "etcd" or not parts.netloc:
        raise ValueError(f"--discovery {url!r} must be etcd://HOST:PORT[,HOST:PORT]/PREFIX")
    endpoints = tuple(e.strip() for e in parts.netloc.split(",") if e.strip())
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--discovery: endpoint {endpoint!r} must be HOST:PORT")
    prefix = parts.path or "/ciuicflow"
    if not _PREFIX_RE.match(prefix) or "//" in prefix:
        raise ValueError(f"--discovery: prefix {prefix!r}: 1-128 characters of A-Z a-z 0-9 . _ - /")
    return EtcdTarget(endpoints, "/" + prefix.strip("/"))


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _unary(channel, service: str, method: str, request_cls, response_cls):
    return channel.unary_unary(service + method, request_serializer=request_cls.SerializeToString,
                               response_deserializer=response_cls.FromString)


class EtcdClient:
    """One channel to the first reachable of ``endpoints`` (gRPC reconnects and picks again by itself)."""

    def __init__(self, endpoints: Sequence[str]):
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.lb_policy_name", "pick_first")]
        # gRPC's ipv4: scheme takes several addresses; a host name goes through DNS as one target.
        target = ("ipv4:" + ",".join(endpoints)) if all(_is_ipv4(e) for e in endpoints) else endpoints[0]
        self.channel = grpc.aio.insecure_channel(target, options=opts)
        self._range = _unary(self.channel, _KV, "Range", epb.RangeRequest, epb.RangeResponse)
        self._put = _unary(self.channel, _KV, "Put", epb.PutRequest, epb.PutResponse)
        self._delete = _unary(self.channel, _KV, "DeleteRange", epb.DeleteRangeRequest, epb.DeleteRangeResponse)
        self._grant = _unary(self.channel, _LEASE, "LeaseGrant", epb.LeaseGrantRequest, epb.LeaseGrantResponse)
        self._revoke = _unary(self.channel, _LEASE, "LeaseRevoke", epb.LeaseRevokeRequest, epb.LeaseRevokeResponse)
        self._keepalive = self.channel.stream_stream(
            _LEASE + "LeaseKeepAlive", request_serializer=epb.LeaseKeepAliveRequest.SerializeToString,
            response_deserializer=epb.LeaseKeepAliveResponse.FromString)
        self._watch = self.channel.stream_stream(
            _WATCH + "Watch", request_serializer=epb.WatchRequest.SerializeToString,
            response_deserializer=epb.WatchResponse.FromString)

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, stub, request, what: str, timeout: float = CALL_TIMEOUT_S):
        try:
            return await stub(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(f"etcd {what}: {exc.code().name} {exc.details()}") from None

    # ------------------------------------------------------------------ keys
    async def range_prefix(self, prefix: bytes, limit: int) -> Tuple[List[epb.KeyValue], bool, int]:
        """Up to ``limit`` keys under ``prefix``: (kvs, more were there, the store's revision)."""
        reply = await self._call(self._range, epb.RangeRequest(key=prefix, range_end=prefix_end(prefix),
                                                               limit=limit), "range")
        return list(reply.kvs[:limit]), bool(reply.more) or len(reply.kvs) > limit, reply.header.revision

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self._call(self._put, epb.PutRequest(key=key, value=value, lease=lease), "put")

    async def delete(self, key: bytes) -> None:
        await self._call(self._delete, epb.DeleteRangeRequest(key=key), "delete")

    # ------------------------------------------------------------------ leases
    async def grant(self, ttl_s: int) -> int:
        reply = await self._call(self._grant, epb.LeaseGrantRequest(TTL=int(ttl_s)), "lease grant")
        if reply.error or not reply.ID:
            raise EtcdError(f"etcd lease grant: {reply.error or 'no lease id'}")
        return reply.ID

    async def revoke(self, lease: int) -> None:
        await self._call(self._revoke, epb.LeaseRevokeRequest(ID=lease), "lease revoke", timeout=1.0)

    async def keep_alive(self, lease: int, every_s: float) -> None:
        """Refresh ``lease`` every ``every_s`` seconds on one stream; returns when etcd says the lease is gone
        (TTL <= 0: expired or revoked), raises EtcdError when the stream breaks."""
        call = self._keepalive()
        try:
            while True:
                await call.write(epb.LeaseKeepAliveRequest(ID=lease))
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise EtcdError("etcd lease keep-alive: stream ended")
                if reply.TTL <= 0:
                    return
                await asyncio.sleep(every_s)
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(f"etcd lease keep-alive: {exc.code().name} {exc.details()}") from None
        except asyncio.InvalidStateError:       # a write after etcd ended the stream (etcd killed)
            raise EtcdError("etcd lease keep-alive: stream ended") from None
        finally:
            call.cancel()

    # ------------------------------------------------------------------ watch
    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[epb.WatchResponse]:
        """The responses of one watch of ``prefix`` from ``start_revision`` (created/canceled ones included:
        the caller decides); raises EtcdError when the stream breaks."""
        call = self._watch()
        try:
            await call.write(epb.WatchRequest(create_request=epb.WatchCreateRequest(
                key=prefix, range_end=prefix_end(prefix), start_revision=start_revision)))
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise EtcdError("etcd watch: stream ended")
                yield reply
        except grpc.aio.AioRpcError as exc:
            raise EtcdError(f"etcd watch: {exc.code().name} {exc.details()}") from None
        except asyncio.InvalidStateError:
            raise EtcdError("etcd watch: stream ended") from None
        finally:
            call.cancel()



def _is_ipv4(endpoint: str) -> bool:
    host = endpoint.rpartition(":")[0]
    return bool(re.match(r"^\d{1,3}(\.\d{1,3}){3}$", host))
