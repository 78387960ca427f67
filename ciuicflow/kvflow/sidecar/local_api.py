"""``KVFlow``, the local API: ``Send`` (a request's header checked, then its messages ingested for the
destination's peer sender), ``Recv`` (a received transfer delivered as it arrives), ``Stats`` and
``ShmProbe``."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from typing import Callable, Optional

import grpc

from ..core.identity import bearer, check_peer_name, tokens_equal
from ..core.limits import seconds
from ..core.transfer import TransferFailed
from ..proto import kvflow_pb2 as pb
from ..proto import kvflow_pb2_grpc as pb_grpc
from ..proto import shm as shmlib
from ..proto.codec import MALFORMED
from ..proto.messages import AUTH_METADATA, FLOW_METADATA, PAYLOAD_KINDS, check_key, priority_from_pb
from .delivery import RecvRing, deliver
from .shm_access import ShmRefused

log = logging.getLogger("ciuicflow.kvflow")

MAX_WAIT_S = 86400.0            # deadlines and receive timeouts beyond this are cut to it
PROBE_NONCE = 16                # ShmProbe: the nonce's length, exactly


class LocalApi(pb_grpc.KVFlowServicer):
    """``KVFlow`` for the inference server beside this sidecar: sends go to ``sender(dest)`` (the PeerSender
    to a peer, None for no peer now: sidecar/peers.py) through ``ingest``; receives come from ``store``. ``api_token``: required if set (None: the
    API is open to every local user, ``--no-api-token``); ``token_hint``: where clients find it;
    ``local_shm``: shared-memory handoff allowed; ``shutting_down()`` refuses new work; ``stats()`` is the
    document ``Stats`` returns."""

    def __init__(self, sender, ingest, store, metrics, *, api_token: Optional[str], local_shm: bool,
                 shutting_down: Callable[[], bool], stats: Callable[[], dict], token_hint: str = "",
                 max_lease_s: float = 600.0, access=None, refusal=None):
        self.sender = sender
        self.ingest = ingest
        self.store = store
        self.metrics = metrics
        self.api_token = api_token
        self.token_hint = token_hint
        self.max_lease_s = max_lease_s
        self.access = access            # shm_access.ShmAccess: which of the caller's files may be opened
        self.local_shm = local_shm
        self.shutting_down = shutting_down
        self.stats = stats
        self.refusal = refusal          # dest -> (status, why) for a send to no current peer (sidecar/peers.py)

    def use_token(self, api_token: Optional[str], hint: str) -> None:
        """The token this API requires from now on, and where its clients find it (app: once published)."""
        self.api_token = api_token
        self.token_hint = hint

    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self.metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    async def _check_auth(self, context):
        token = self.api_token
        if token and not tokens_equal(bearer(dict(context.invocation_metadata()).get(AUTH_METADATA)), token):
            await self._reject(context, grpc.StatusCode.UNAUTHENTICATED,
                               "local API needs a valid token: Client(token=...), $CIUICFLOW_KVFLOW_API_TOKEN or "
                               f"$CIUICFLOW_KVFLOW_API_TOKEN_FILE{self.token_hint}")

    # ------------------------------------------------------------------ Send
    async def Send(self, request_iterator, context):
        await self._check_auth(context)
        if self.shutting_down():
            await self._reject(context, grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
        flow = dict(context.invocation_metadata()).get(FLOW_METADATA, "").lower() == "enabled"
        iterator = request_iterator.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "empty Send stream: expected a SendHeader")
        if first is MALFORMED:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed SendRequest")
        if first.WhichOneof("msg") != "header":
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "the first SendRequest must be a header")
        h = first.header
        err = check_key(h.key)
        priority = priority_from_pb(h.priority)
        if err:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, err)
        if priority is None:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, f"unknown priority value {h.priority}")
        if h.payload_kind and h.payload_kind not in PAYLOAD_KINDS:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"payload_kind must be one of {PAYLOAD_KINDS}, got {h.payload_kind!r}")
        try:        # NaN never expires, inf pins memory for ever: refused, or cut to the maxima
            deadline_s = seconds(h.deadline_s, maximum=MAX_WAIT_S, what="deadline_s")
            lease_s = seconds(h.lease_s, maximum=self.max_lease_s, what="lease_s")
        except ValueError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if len(h.idempotency_key) > 256 or "\x00" in h.idempotency_key:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key: at most 256 characters")
        # the same key names the same transfer on every try (and after a restart of this sidecar)
        uuid = f"idem:{h.idempotency_key}" if h.idempotency_key else None
        sender = self.sender(h.dest)
        if sender is None:
            await self._reject(context, *self.refusal(h.dest))
        try:
            t, done = sender.create(h.key, priority, flow, deadline_s, h.payload_kind or "bytes", h.resume,
                                    lease_s, uuid)
        except TransferFailed as exc:
            await self._reject(context, exc.code, exc.message)
        ingest = asyncio.create_task(self.ingest.run(sender, t, iterator))
        try:
            await asyncio.wait({ingest, done}, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                try:
                    ingest.result()
                except TransferFailed as exc:
                    sender.fail(t, exc.code, exc.message)
                except Exception as exc:    # noqa: BLE001
                    sender.fail(t, grpc.StatusCode.CANCELLED, f"local sender stream broke: {exc}")
            try:
                return await done
            except TransferFailed as exc:
                if exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
                    self.metrics.rejected.labels(exc.code.name).inc()
                await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            sender.fail(t, grpc.StatusCode.CANCELLED, "the local client cancelled the send")
            raise
        finally:
            if not ingest.done():
                ingest.cancel()
            ingest.add_done_callback(lambda task: task.cancelled() or task.exception())

    # ------------------------------------------------------------------ Recv
    async def Recv(self, request, context):
        await self._check_auth(context)
        if request is MALFORMED:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed RecvRequest")
        err = check_key(request.key)
        if err:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, err)
        try:
            timeout_s = seconds(request.timeout_s, maximum=MAX_WAIT_S, what="timeout_s")
        except ValueError as exc:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.source and check_peer_name(request.source):
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, check_peer_name(request.source))
        store = self.store
        source = request.source
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        tomb = store.tombstone(request.key, source)
        if not store.find(request.key, source) and tomb is not None and tomb[0] == "expired":
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"transfer {request.key!r} expired: not collected within its lease")
        found = await store.wait_for(request.key, deadline, source)
        if not found:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no transfer with key {request.key!r} arrived within {timeout_s:g}s")
        if len(found) > 1:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfers with key {request.key!r} from {len(found)} peers "
                               f"({', '.join(sorted(e.source for e in found))}): name the source")
        entry = found[0]
        if entry.readers:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {request.key!r} is already being received")
        ring = None
        if request.shm_path and self.local_shm and request.shm_ring_bytes:
            try:
                ring = RecvRing(self.access.open(request.shm_path), request.shm_ring_bytes)
                self.access.unlink(request.shm_path, ring.fd)
            except ShmRefused:
                log.info("Recv %r: shared-memory handle refused, sending in-band", request.key)
        async for reply in deliver(entry, store, ring, deadline, timeout_s, self.shutting_down, context,
                                   manual_ack=request.manual_ack):
            yield reply

    # ------------------------------------------------------------------ Acknowledge
    async def Acknowledge(self, request, context):
        """The consumer has a transfer it received with manual_ack: it may go (idempotent)."""
        await self._check_auth(context)
        if request is MALFORMED:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed AcknowledgeRequest")
        err = check_key(request.key) or (check_peer_name(request.source) if request.source else None)
        if err:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, err)
        found = self.store.find(request.key, request.source)
        if len(found) > 1:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfers with key {request.key!r} from {len(found)} peers: name the source")
        if found:
            entry = found[0]
            if not entry.complete or entry.readers:
                state = "being received" if entry.complete else "incomplete"
                await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION, f"transfer {request.key!r} is {state}")
            self.store.collect(entry)
            return pb.AcknowledgeReply()
        tomb = self.store.tombstone(request.key, request.source)
        if tomb is not None and tomb[0] == "collected":
            return pb.AcknowledgeReply()
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no transfer {request.key!r} to acknowledge"
                            + (" (its lease expired)" if tomb is not None and tomb[0] == "expired" else ""))

    # ------------------------------------------------------------------ Stats
    async def Stats(self, request, context):
        await self._check_auth(context)
        return pb.StatsReply(json=json.dumps(self.stats()))

    # ------------------------------------------------------------------ ShmProbe
    async def ShmProbe(self, request, context):
        await self._check_auth(context)
        if request is MALFORMED:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed ShmProbeRequest")
        if not self.local_shm:
            return pb.ShmProbeReply(ok=False, message="shared memory is off (--no-local-shm)")
        if len(request.nonce) != PROBE_NONCE:       # no shorter nonce: no guessing a file byte by byte
            return pb.ShmProbeReply(ok=False, message=f"the nonce must be {PROBE_NONCE} bytes")
        try:
            fd = self.access.open(request.path)
        except ShmRefused as exc:       # says nothing about what was named
            return pb.ShmProbeReply(ok=False, message=str(exc))
        try:
            seen = os.pread(fd, PROBE_NONCE, 0)
            same = hmac.compare_digest(seen, request.nonce)
            if same:
                # written back after the first page: the client checks that this sidecar can write its files
                os.pwrite(fd, seen, shmlib.PAGE)
        except OSError:
            return pb.ShmProbeReply(ok=False, message="cannot use this shared-memory file")
        finally:
            os.close(fd)
        if not same:
            return pb.ShmProbeReply(ok=False, message="the file's content differs (another host or namespace)")
        return pb.ShmProbeReply(ok=True)
