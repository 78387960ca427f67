"""The KV-flow sidecar process: ``ciuicflow-sidecar`` / ``python -m ciuicflow.kvflow.server``.

Two gRPC servers on one asyncio event loop:
  * the local API (``KVFlow``: Send, Recv, Stats) on ``--api`` (loopback unless ``--allow-remote-api``);
  * the peer transport (``KVFlowPeer.Link``) on ``--listen``, with optional mutual TLS and a shared token.
Both also serve gRPC health checking and reflection. Prometheus metrics on ``--metrics-port``.
"""
from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from typing import Dict, List, Optional

import crc32c
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..core.budget import MemoryBudget
from ..proto.messages import (AUTH_METADATA, FLOW_METADATA, LOCAL_SERVICE, PAYLOAD_KINDS, PEER_SERVICE, check_key,
                     check_part_info, format_hostport, parse_hostport, priority_from_pb, uninitialized)
from .config import SidecarConfig, load_config
from .metrics import Metrics
from ..proto import kvflow_pb2 as pb
from .peer_service import MALFORMED, PeerService, Store
from ..proto import shm as shmlib
from .peer_sender import OutChunk, PeerLink, TransferFailed
from ..transports.tcp import DataPlaneServer

log = logging.getLogger("ciuicflow.kvflow")

RING_POLL_S = 0.0005     # Recv into a full ring: first wait for the client to read (doubling up to 10x)
MAX_PACKED_PARTS = 64   # most whole parts in one packed chunk (bounds its header)
ABORT_FLUSH_S = 5.0     # on shutdown, how long a link may take to deliver its last frames (the aborts)


def _safe_deserializer(cls):
    def deserialize(data: bytes):
        try:
            return cls.FromString(data)
        except Exception:       # noqa: BLE001 - reported as INVALID_ARGUMENT by the handler
            return MALFORMED
    return deserialize


class _Cutter:
    """Cuts the local client's messages of one transfer into chunks of at most ``chunk_size`` bytes,
    checking that parts come in order and match their description."""

    def __init__(self, chunk_size: int, whole_part_bytes: int = 0):
        self.base_chunk = chunk_size  # the link's chunk size (set_link_chunk), for parts that start from now on
        self.chunk_size = chunk_size  # the current part's
        # A part no larger than this goes as one chunk (no short tail chunk with its own ack): KV layers
        # are often a little over a chunk (e.g. 288 KiB), and cutting them in 256 KiB + 32 KiB doubles the
        # per-chunk cost for no gain in preemption.
        self.min_whole_bytes = max(int(whole_part_bytes), chunk_size)
        self.whole_part_bytes = self.min_whole_bytes
        self.part = 0                 # the part being filled
        self.offset = 0               # bytes of it received
        self.nbytes: Optional[int] = None
        self.info: Optional[pb.PartInfo] = None
        self.buf = bytearray()
        self.buf_offset = 0           # part offset of buf[0]

    def set_link_chunk(self, size: int) -> None:
        """The link's chunk size now (PeerLink.chunk_bytes): parts that start from now on are cut at it,
        and whole parts may be as large."""
        self.base_chunk = size
        self.whole_part_bytes = max(self.min_whole_bytes, size)

    def feed(self, d: pb.SendData) -> List[OutChunk]:
        self.check(d.part, d.offset, d.info if d.HasField("info") else None, len(d.data))
        return self.feed_bytes(d.data)

    def check(self, part: int, offset: int, info: Optional[pb.PartInfo], n: int) -> None:
        """Validate the next message (part, offset, PartInfo on a part's first message, n bytes)."""
        if self.nbytes is None:       # a new part starts
            if part != self.part or offset != 0:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"chunk out of order: got part {part} offset {offset}, "
                                     f"expected part {self.part} offset 0")
            if info is None:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"first message of part {part} has no PartInfo")
            err = check_part_info(info, self.part)
            if err:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, err)
            self.nbytes = info.nbytes
            self.info = info
            self.chunk_size = self.nbytes if 0 < self.nbytes <= self.whole_part_bytes else self.base_chunk
        elif part != self.part or offset != self.offset:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"chunk out of order: got part {part} offset {offset}, "
                                 f"expected part {self.part} offset {self.offset}")
        if self.offset + n > self.nbytes:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"part {self.part}: {self.offset + n} bytes sent, part has {self.nbytes}")

    @property
    def piece_bytes(self) -> int:
        """How much of a shared-memory part to read at once: one chunk (whole parts stay whole)."""
        return self.chunk_size

    def feed_bytes(self, data: bytes) -> List[OutChunk]:
        """The bytes of the message just checked (possibly a piece of it: then check() the rest again)."""
        self.offset += len(data)
        out = []
        pos = 0
        if self.buf:
            need = self.chunk_size - len(self.buf)
            self.buf += data[:need]
            pos = min(need, len(data))
            if len(self.buf) == self.chunk_size:
                out.append(self._emit(bytes(self.buf)))
                self.buf = bytearray()
        # Whole chunks straight from the message (no copy when the message is exactly one chunk).
        while len(data) - pos >= self.chunk_size:
            piece = data if pos == 0 and len(data) == self.chunk_size else data[pos:pos + self.chunk_size]
            out.append(self._emit(piece))
            pos += self.chunk_size
        if pos < len(data):
            self.buf += data[pos:]
        if self.offset == self.nbytes:
            if self.buf or not out:
                out.append(self._emit(bytes(self.buf)))
                self.buf = bytearray()
            self.part += 1
            self.offset = 0
            self.nbytes = None
            self.buf_offset = 0
        return out

    def packable(self, d: pb.SendData) -> int:
        """Bytes of ``d`` when it is a whole part in shared memory, at a part boundary, that may share a
        chunk with its neighbours (0 otherwise)."""
        if (self.nbytes is not None or d.offset or d.data or not d.HasField("info")
                or not d.HasField("shm") or d.shm.length != d.info.nbytes):
            return 0
        return d.shm.length if 0 < d.shm.length <= self.whole_part_bytes else 0

    def take_whole(self, d: pb.SendData) -> None:
        """Check ``d`` (a packable part) and count it as sent whole, in a packed chunk."""
        self.check(d.part, d.offset, d.info, d.shm.length)
        self.part += 1
        self.offset = 0
        self.nbytes = None

    def _emit(self, data: bytes) -> OutChunk:
        info = self.info if self.buf_offset == 0 else None
        chunk = OutChunk(self.part, self.buf_offset, data, crc32c.crc32c(data), info)
        self.buf_offset += len(data)
        return chunk

    def finish(self, num_parts: int) -> None:
        if self.nbytes is not None:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"SendEnd before part {self.part} was complete ({self.offset} of {self.nbytes} bytes)")
        if num_parts != self.part:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"SendEnd says {num_parts} parts, {self.part} were sent")


class _RecvRing:
    """The sidecar's side of a receiving client's ring (see shm.py): writes chunks into it, never more than
    the ring ahead of what the client has read."""

    def __init__(self, fd: int, ring: int):
        self.fd, self.ring = fd, int(ring)
        self.pos = 0              # logical position of the next byte written
        self.read = 0             # how far the client has read, as last seen

    def _room(self, n: int) -> bool:
        if self.pos + n - self.read <= self.ring:
            return True
        self.read = min(shmlib.read_position(self.fd), self.pos)
        return self.pos + n - self.read <= self.ring

    def batch(self, chunks, pos: int):
        """RecvData handles for ``chunks[pos:]``, as far as they fit (at most 1024 parts); the next pos.
        A chunk larger than the whole ring goes in-band."""
        out = []
        while pos < len(chunks) and len(out) < 1024:
            c = chunks[pos]
            n = len(c.data)
            in_ring = 0 < n <= self.ring
            if in_ring and not self._room(n):
                break
            pos += 1
            if not in_ring:
                out += in_band(c)
                continue
            shmlib.ring_write(self.fd, self.ring, c.data, self.pos)
            for part, offset, info, start, length in c.spans():
                ref = pb.ShmRef(offset=self.pos + start, length=length) if length else None
                out.append(pb.RecvData(part=part, offset=offset, info=info, shm=ref))
            self.pos += n
        return out, pos


def in_band(c) -> List[pb.RecvData]:
    """The parts of chunk ``c`` with their bytes in the messages themselves."""
    return [pb.RecvData(part=part, offset=offset, info=info, data=bytes(c.data[start:start + length]))
            for part, offset, info, start, length in c.spans()]


class LocalService:
    """``KVFlow``: the API of the inference server beside this sidecar."""

    def __init__(self, sidecar: "Sidecar"):
        self.sc = sidecar

    async def _reject(self, context, code: grpc.StatusCode, message: str):
        self.sc.metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    async def _check_auth(self, context):
        token = self.sc.cfg.api_token
        if token and dict(context.invocation_metadata()).get(AUTH_METADATA) != f"Bearer {token}":
            await self._reject(context, grpc.StatusCode.UNAUTHENTICATED, "local API needs a valid token")

    # ------------------------------------------------------------------ Send
    async def Send(self, request_iterator, context):
        await self._check_auth(context)
        sc = self.sc
        if sc.shutting_down:
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
        if h.deadline_s < 0 or h.lease_s < 0:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "deadline_s and lease_s must be >= 0")
        link = sc.links.get(h.dest)
        if link is None:
            known = ", ".join(sorted(sc.links)) or "none"
            await self._reject(context, grpc.StatusCode.NOT_FOUND, f"unknown peer {h.dest!r} (known: {known})")
        try:
            t = link.create_transfer(h.key, priority, flow, h.deadline_s, h.payload_kind or "bytes",
                                     h.resume, h.lease_s)
        except TransferFailed as exc:
            await self._reject(context, exc.code, exc.message)
        ingest = asyncio.create_task(self._ingest(link, t, iterator))
        try:
            await asyncio.wait({ingest, t.done}, return_when=asyncio.FIRST_COMPLETED)
            if not t.done.done():
                try:
                    ingest.result()
                except TransferFailed as exc:
                    link.fail(t, exc.code, exc.message)
                except Exception as exc:    # noqa: BLE001
                    link.fail(t, grpc.StatusCode.CANCELLED, f"local sender stream broke: {exc}")
            try:
                return await t.done
            except TransferFailed as exc:
                if exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT):
                    sc.metrics.rejected.labels(exc.code.name).inc()
                await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            link.fail(t, grpc.StatusCode.CANCELLED, "the local client cancelled the send")
            raise
        finally:
            if not ingest.done():
                ingest.cancel()
            ingest.add_done_callback(lambda task: task.cancelled() or task.exception())

    def _open_shm(self, files: Dict[str, int], path: str) -> int:
        fd = files.get(path)
        if fd is None:
            if not self.sc.cfg.local_shm:
                raise TransferFailed(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is off (--no-local-shm)")
            if len(files) >= 16:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "too many shared-memory files in one Send")
            try:
                fd = shmlib.open_checked(path, shmlib.shm_dir(), write=True)   # write: to say what it has read
            except (OSError, ValueError) as exc:
                raise TransferFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"cannot open shared-memory file: {exc}") from None
            files[path] = fd
            shmlib.unlink(path)         # both sides hold it open: no name left behind if either dies
        return fd

    async def _ingest(self, link: PeerLink, t, iterator) -> None:
        files: Dict[str, int] = {}
        try:
            await self._ingest_stream(link, t, iterator, files)
        finally:
            for fd in files.values():
                os.close(fd)

    def _shm_chunks(self, cutter: "_Cutter", d: pb.SendData, files: Dict[str, int]):
        """Chunks of a shared-memory SendData, read one chunk at a time (after the readahead wait of the
        previous one, so memory caps and ingest back-pressure work as for in-band bytes)."""
        ref = d.shm
        if d.data:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "SendData with both data and shm")
        cutter.check(d.part, d.offset, d.info if d.HasField("info") else None, ref.length)
        fd = self._open_shm(files, ref.path)
        pos, end = ref.offset, ref.offset + ref.length
        while pos < end:
            n = min(cutter.piece_bytes, end - pos)
            data = self._read_ring(fd, ref, pos, n)
            pos += n
            yield from cutter.feed_bytes(data)

    @staticmethod
    def _read_ring(fd: int, ref: pb.ShmRef, pos: int, n: int, into: Optional[memoryview] = None):
        """``n`` bytes at logical position ``pos`` of the client's ring (into ``into`` when given); the
        client may then write there again."""
        try:
            if into is None:
                data = shmlib.ring_read(fd, ref.ring_bytes, pos, n)
            else:
                shmlib.ring_read_into(fd, ref.ring_bytes, into, pos)
                data = into
            shmlib.publish_read(fd, pos + n)
        except (OSError, EOFError, ValueError) as exc:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, f"reading shared memory: {exc}") from None
        return data

    def _packed_chunk(self, cutter: "_Cutter", group, files: Dict[str, int]) -> OutChunk:
        """Whole small parts from shared memory read into one chunk: one checksum, one frame and one ack
        for all of them instead of each (the per-chunk work of two sidecars and two clients is about half
        the CPU of a transfer of 300 KB layers)."""
        first = cutter.part
        buf = uninitialized(sum(d.shm.length for d in group))
        view = memoryview(buf)
        pos = 0
        for d in group:
            cutter.take_whole(d)
            n = d.shm.length
            self._read_ring(self._open_shm(files, d.shm.path), d.shm, d.shm.offset, n, view[pos:pos + n])
            pos += n
        infos = [d.info for d in group]
        return OutChunk(first, 0, buf, crc32c.crc32c(buf), infos[0], tuple(infos[1:]))

    def _batch_chunks(self, cutter: "_Cutter", datas, files: Dict[str, int], pack_bytes: int):
        """The chunks of one message's SendData items, in order; runs of whole small parts in shared memory
        are packed (up to ``pack_bytes`` and MAX_PACKED_PARTS per chunk)."""
        i = 0
        while i < len(datas):
            group, total = [], 0
            while i + len(group) < len(datas) and len(group) < MAX_PACKED_PARTS:
                n = cutter.packable(datas[i + len(group)])
                if not n or total + n > pack_bytes:
                    break
                group.append(datas[i + len(group)])
                total += n
            if len(group) > 1:
                i += len(group)
                yield self._packed_chunk(cutter, group, files)
                continue
            d = datas[i]
            i += 1
            yield from (self._shm_chunks(cutter, d, files) if d.HasField("shm") else cutter.feed(d))

    async def _ingest_stream(self, link: PeerLink, t, iterator, files: Dict[str, int]) -> None:
        sc = self.sc
        cutter = _Cutter(sc.cfg.chunk_size, sc.cfg.whole_part_bytes)
        chunk_limit = min(sc.cfg.max_chunk_size, sc.cfg.max_message_bytes - (64 << 10))   # the receiver's limit
        async for req in iterator:
            if t.finished:
                return
            if req is MALFORMED:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "malformed SendRequest")
            kind = req.WhichOneof("msg")
            if kind == "data" or kind == "batch":
                datas = (req.data,) if kind == "data" else req.batch.data
            else:
                datas = ()
            if datas:
                link_chunk = link.chunk_bytes(sc.cfg.chunk_size, chunk_limit)   # also the packing limit
                cutter.set_link_chunk(link_chunk)
                for chunk in self._batch_chunks(cutter, datas, files, link_chunk):
                    await link.wait_readahead(t, sc.cfg.ingest_readahead)
                    if t.finished:
                        return
                    n = len(chunk.data)
                    too_big = t.buffered + n > min(sc.budget.peer_cap, sc.budget.total_cap)
                    if too_big and link.durable is None:
                        # Whether the peer spools decides what fits: learn it from the handshake.
                        stop = time.monotonic() + sc.cfg.admission_timeout_s
                        while link.durable is None and not t.finished and time.monotonic() < stop:
                            await asyncio.sleep(0.01)
                    if too_big and not link.durable:
                        # Kept until the peer commits it (to resend after a restart of the peer), so it
                        # can never fit: refuse now rather than after the admission timeout.
                        raise TransferFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                             f"transfer {t.key!r} is larger than the memory cap "
                                             f"({sc.budget.peer_cap} bytes per peer; a receiver with "
                                             f"--spool-dir lifts this)")
                    if not await sc.budget.reserve(link.name, n, sc.cfg.admission_timeout_s):
                        raise TransferFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                             f"over the memory cap for {sc.cfg.admission_timeout_s:g}s "
                                             f"(peer {link.name!r}: {sc.budget.per_peer.get(link.name, 0)} bytes "
                                             f"buffered, total {sc.budget.used})")
                    if t.finished:
                        sc.budget.release(link.name, n)
                        return
                    t.buffered += n
                    link.add_chunk(t, chunk)
            if datas:
                continue
            if kind == "end":
                cutter.finish(req.end.num_parts)
                link.close_transfer(t, req.end.num_parts)
                return
            elif kind == "header":
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "a second SendHeader in one Send")
            else:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "empty SendRequest")
        raise TransferFailed(grpc.StatusCode.CANCELLED, "the Send stream ended without SendEnd")

    # ------------------------------------------------------------------ Recv
    async def Recv(self, request, context):
        await self._check_auth(context)
        if request is MALFORMED:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed RecvRequest")
        err = check_key(request.key)
        if err:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, err)
        if request.timeout_s < 0:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be >= 0")
        store = self.sc.store
        deadline = time.monotonic() + request.timeout_s if request.timeout_s > 0 else None
        tomb = store.tombstones.get(request.key)
        if request.key not in store.entries and tomb is not None and tomb[0] == "expired":
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"transfer {request.key!r} expired: not collected within its lease")
        entry = await store.wait_for(request.key, deadline)
        if entry is None:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no transfer with key {request.key!r} arrived within {request.timeout_s:g}s")
        if entry.readers:
            await self._reject(context, grpc.StatusCode.FAILED_PRECONDITION,
                               f"transfer {request.key!r} is already being received")
        entry.readers += 1
        ring = None
        if request.shm_path and self.sc.cfg.local_shm and request.shm_ring_bytes:
            try:
                ring = _RecvRing(shmlib.open_checked(request.shm_path, shmlib.shm_dir(), write=True),
                                 request.shm_ring_bytes)
                shmlib.unlink(request.shm_path)
            except (OSError, ValueError) as exc:
                log.info("Recv %r: shared memory not possible, sending in-band: %s", request.key, exc)
        try:
            yield pb.RecvReply(header=pb.RecvHeader(key=entry.key, source=entry.source,
                                                    payload_kind=entry.payload_kind,
                                                    priority={"high": pb.HIGH, "normal": pb.NORMAL,
                                                              "low": pb.LOW}[entry.priority]))
            pos = 0
            generation = entry.generation
            ring_wait = RING_POLL_S
            while True:
                if entry.generation != generation:
                    if any(g > generation and seq < pos for g, seq in entry.truncations):
                        await context.abort(grpc.StatusCode.ABORTED,
                                            f"transfer {entry.key!r} was resumed with different content; "
                                            "receive it again")
                    generation = entry.generation
                ring_full = False
                if ring is not None and pos < len(entry.chunks):
                    # Shared memory: the chunks that arrived so far (as many as the ring has room for) go
                    # in one message of handles.
                    try:
                        batch, pos = ring.batch(entry.chunks, pos)
                    except OSError as exc:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"writing shared memory for {entry.key!r}: {exc}")
                    if batch:
                        ring_wait = RING_POLL_S
                        yield pb.RecvReply(batch=pb.RecvBatch(data=batch))
                        continue
                    ring_full = True
                while ring is None and pos < len(entry.chunks):
                    c = entry.chunks[pos]
                    pos += 1
                    for d in in_band(c):
                        yield pb.RecvReply(data=d)
                if entry.failed:
                    code, message = entry.failed
                    await context.abort(code, message)
                if entry.complete and pos >= len(entry.chunks):
                    store.collect(entry)
                    return
                if self.sc.shutting_down:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"transfer {entry.key!r} incomplete after {request.timeout_s:g}s "
                                        f"({len(entry.chunks)} chunks arrived)")
                if ring_full:       # wait for the client to read (it says so only in the ring's header)
                    await asyncio.sleep(ring_wait)
                    ring_wait = min(2 * ring_wait, 10 * RING_POLL_S)
                else:
                    await entry.changed(1.0 if timeout is None else min(timeout, 1.0))
        finally:
            if ring is not None:
                os.close(ring.fd)
            entry.readers -= 1
            entry.last_activity = time.monotonic()

    # ------------------------------------------------------------------ Stats
    async def Stats(self, request, context):
        await self._check_auth(context)
        return pb.StatsReply(json=json.dumps(self.sc.stats()))

    # ------------------------------------------------------------------ ShmProbe
    async def ShmProbe(self, request, context):
        await self._check_auth(context)
        if request is MALFORMED:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, "malformed ShmProbeRequest")
        if not self.sc.cfg.local_shm:
            return pb.ShmProbeReply(ok=False, message="shared memory is off (--no-local-shm)")
        try:
            fd = shmlib.open_checked(request.path, shmlib.shm_dir(), write=True)
        except (OSError, ValueError) as exc:
            return pb.ShmProbeReply(ok=False, message=f"cannot open {request.path!r}: {exc}")
        try:
            seen = os.pread(fd, len(request.nonce), 0)
            if request.nonce and seen == request.nonce:
                # written back after the first page: the client checks that this sidecar can write its files
                os.pwrite(fd, seen, shmlib.PAGE)
        except OSError as exc:
            return pb.ShmProbeReply(ok=False, message=f"cannot use {request.path!r}: {exc}")
        finally:
            os.close(fd)
        if not request.nonce or seen != request.nonce:
            return pb.ShmProbeReply(ok=False, message="the file's content differs (another host or namespace)")
        return pb.ShmProbeReply(ok=True)


class Sidecar:
    def __init__(self, cfg: SidecarConfig):
        self.cfg = cfg
        self.metrics = Metrics()
        self.budget = MemoryBudget(cfg.max_total_bytes, cfg.max_peer_bytes, on_change=self._budget_changed)
        self.store = Store(self)
        self.links: Dict[str, PeerLink] = {}
        self.shutting_down = False
        self.started = time.monotonic()
        self.api_address = ""
        self.listen_address = ""
        self.data_plane: Optional[DataPlaneServer] = None
        self.metrics_address = ""
        self._servers: List[grpc.aio.Server] = []
        self._health: List[health.aio.HealthServicer] = []
        self._tasks: List[asyncio.Task] = []

    def _budget_changed(self, peer: str, peer_used: int, total: int) -> None:
        self.metrics.buffered.labels(peer).set(peer_used)
        self.metrics.buffered_total.set(total)

    # ------------------------------------------------------------------ channels
    def _read(self, path: Optional[str]) -> Optional[bytes]:
        if not path:
            return None
        with open(path, "rb") as fh:
            return fh.read()

    def _options(self):
        n = self.cfg.max_message_bytes
        return [
            ("grpc.max_receive_message_length", n),
            ("grpc.max_send_message_length", n),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]

    def make_channel(self, address: str) -> grpc.aio.Channel:
        cfg = self.cfg
        options = self._options() + [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if cfg.tls_cert:
            if cfg.tls_server_name:
                options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=self._read(cfg.tls_ca),
                                                 private_key=self._read(cfg.tls_key),
                                                 certificate_chain=self._read(cfg.tls_cert))
            return grpc.aio.secure_channel(address, creds, options=options)
        return grpc.aio.insecure_channel(address, options=options)

    # ------------------------------------------------------------------ start / stop
    def _new_server(self, service_name: str, handlers, options=()) -> grpc.aio.Server:
        server = grpc.aio.server(options=self._options() + list(options))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        reflection.enable_server_reflection(
            (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self._health.append((hs, service_name))
        self._servers.append(server)
        return server

    async def start(self) -> None:
        cfg = self.cfg
        local = LocalService(self)
        api_server = self._new_server(LOCAL_SERVICE, {
            "Send": grpc.stream_unary_rpc_method_handler(
                local.Send, request_deserializer=_safe_deserializer(pb.SendRequest),
                response_serializer=pb.SendReply.SerializeToString),
            "Recv": grpc.unary_stream_rpc_method_handler(
                local.Recv, request_deserializer=_safe_deserializer(pb.RecvRequest),
                response_serializer=pb.RecvReply.SerializeToString),
            "Stats": grpc.unary_unary_rpc_method_handler(
                local.Stats, request_deserializer=_safe_deserializer(pb.StatsRequest),
                response_serializer=pb.StatsReply.SerializeToString),
            "ShmProbe": grpc.unary_unary_rpc_method_handler(
                local.ShmProbe, request_deserializer=_safe_deserializer(pb.ShmProbeRequest),
                response_serializer=pb.ShmProbeReply.SerializeToString),
        }, options=[("grpc.http2.bdp_probe", 0)])   # keep HTTP/2 windows small: the memory cap is the buffer
        api_host, api_port = parse_hostport(cfg.api)
        bound = api_server.add_insecure_port(format_hostport(api_host, api_port))
        if bound == 0:
            raise RuntimeError(f"cannot bind the local API on {cfg.api}")
        self.api_address = format_hostport(api_host, bound)

        peer = PeerService(self)
        peer_server = self._new_server(PEER_SERVICE, {
            "Link": grpc.stream_stream_rpc_method_handler(
                peer.Link, request_deserializer=_safe_deserializer(pb.PeerFrame),
                response_serializer=pb.PeerReply.SerializeToString),
            "DataPlane": grpc.unary_unary_rpc_method_handler(
                peer.DataPlane, request_deserializer=_safe_deserializer(pb.DataPlaneRequest),
                response_serializer=pb.DataPlaneReply.SerializeToString),
        })
        host, port = parse_hostport(cfg.listen)
        listen = format_hostport(host, port)
        if cfg.tls_cert:
            creds = grpc.ssl_server_credentials([(self._read(cfg.tls_key), self._read(cfg.tls_cert))],
                                                root_certificates=self._read(cfg.tls_ca),
                                                require_client_auth=bool(cfg.tls_ca))
            bound = peer_server.add_secure_port(listen, creds)
        else:
            bound = peer_server.add_insecure_port(listen)
        if bound == 0:
            raise RuntimeError(f"cannot bind the peer port on {cfg.listen}")
        self.listen_address = format_hostport(host, bound)
        if cfg.data_port >= 0 and not cfg.tls_cert:     # no TLS on the data plane: TLS peers keep to gRPC
            self.data_plane = DataPlaneServer(peer, _safe_deserializer(pb.PeerFrame), cfg.max_message_bytes)
            await self.data_plane.start(host, cfg.data_port)

        if cfg.spool_dir:
            from .spool import Spool
            self.store.spool = Spool(cfg.spool_dir)
            restored = self.store.spool.restore(self)
            if restored:
                log.info("restored %d transfer(s) from spool %s", restored, cfg.spool_dir)

        for server in self._servers:
            await server.start()
        for hs, name in self._health:
            await hs.set("", health_pb2.HealthCheckResponse.SERVING)
            await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            self.metrics_address = format_hostport(cfg.metrics_host, cfg.metrics_port)
        for name, address in cfg.peers.items():
            link = PeerLink(self, name, address)
            self.links[name] = link
            link.start()
        self._tasks.append(asyncio.create_task(self._sweeper()))

    async def _sweeper(self) -> None:
        period = max(0.05, min(1.0, self.cfg.lease_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                self.store.sweep()
            except Exception:   # noqa: BLE001 - keep serving
                log.exception("sweep failed")

    async def stop(self) -> None:
        """Graceful shutdown: refuse new work, let in-flight transfers finish for ``drain_s``, then fail the
        rest explicitly (UNAVAILABLE to local senders and to receivers)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: draining for up to %gs", self.cfg.drain_s)
        for hs, _ in self._health:
            await hs.enter_graceful_shutdown()
        deadline = time.monotonic() + self.cfg.drain_s
        while time.monotonic() < deadline and any(link.transfers for link in self.links.values()):
            await asyncio.sleep(0.05)
        for link in self.links.values():
            link.fail_all(grpc.StatusCode.UNAVAILABLE, "sending sidecar is shutting down")
        # The aborts must reach the receivers, behind whatever data is still in the streams.
        await asyncio.gather(*(link.close(flush_s=ABORT_FLUSH_S) for link in self.links.values()))
        for entry in list(self.store.entries.values()):
            entry.notify()            # Recv streams see shutting_down
        for task in self._tasks:
            task.cancel()
        if self.data_plane is not None:
            await self.data_plane.stop()
        await asyncio.gather(*(server.stop(1.0) for server in self._servers))
        log.info("stopped")

    def stats(self) -> dict:
        return {
            "name": self.cfg.name,
            "uptime_s": time.monotonic() - self.started,
            "api": self.api_address,
            "listen": self.listen_address,
            "data_port": self.data_plane.port if self.data_plane else None,
            "chunk_size": self.cfg.chunk_size,
            "memory": self.budget.snapshot(),
            "peers": {name: link.snapshot() for name, link in self.links.items()},
            "store": self.store.snapshot(),
            "shutting_down": self.shutting_down,
        }


async def serve(cfg: SidecarConfig, ready=None) -> None:
    sidecar = Sidecar(cfg)
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    peers = ",".join(f"{n}={a}" for n, a in cfg.peers.items()) or "-"
    log.info("sidecar %r ready: api=%s listen=%s metrics=%s peers=%s tls=%s token=%s data-plane=%s", cfg.name,
             sidecar.api_address, sidecar.listen_address, sidecar.metrics_address or "-", peers,
             "mutual" if cfg.tls_ca else ("on" if cfg.tls_cert else "off"), "on" if cfg.token else "off",
             f"tcp:{sidecar.data_plane.port}" if sidecar.data_plane else "off")
    if ready is not None:
        ready(sidecar)
    await stop.wait()
    await sidecar.stop()


def tune_malloc() -> bool:
    """Keep freed chunk buffers in the heap instead of giving them back to the OS at once.

    Every chunk (256 KiB..4 MiB) is a fresh buffer; with glibc's defaults each is a new mmap (or a heap
    top that is trimmed again), so every chunk costs ~70+ page faults per copy. Measured on loopback:
    a third of the sidecar's CPU. Large buffers then come from the heap and are reused; the memory caps
    (--max-total-bytes) still bound what is held. ``CIUICFLOW_KVFLOW_MALLOC_TUNE=0`` turns this off."""
    if os.environ.get("CIUICFLOW_KVFLOW_MALLOC_TUNE", "1") == "0":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 and ok
        return ok
    except (OSError, AttributeError):
        return False


def main(argv=None) -> int:
    try:
        cfg = load_config(argv)
    except (ValueError, OSError) as exc:
        print(f"ciuicflow-sidecar: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()
    # Every chunk allocates a few dozen short-lived objects (messages, futures, callbacks), which triggered a
    # full young-generation collection every few chunks: ~15% of a sidecar's CPU in a profile. The objects
    # die young without cycles, so collect far less often; startup's objects are frozen out of the scans.
    gc.set_threshold(50_000, 20, 20)
    try:
        asyncio.run(serve(cfg, ready=lambda _: gc.freeze()))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
