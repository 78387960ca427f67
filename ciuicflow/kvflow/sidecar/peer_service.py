"""Receiving side of a sidecar: the ``KVFlowPeer`` service and the store that ``Recv`` collects from.

Chunks are accepted strictly in order per transfer (seq == chunks held), after their crc32c is checked;
an out-of-order chunk is dropped (the sender goes back), a corrupt one answered ``ACK_CORRUPT``, one over
the memory cap ``ACK_BUSY``. A completed transfer waits for ``Recv`` for at most its lease.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Dict, List, Optional, Tuple

import crc32c
import grpc

from ..proto.messages import AUTH_METADATA, PEER_METADATA, check_key, check_part_info, priority_from_pb, status_code
from ..proto import kvflow_pb2 as pb
from ..transports.tcp import ChunkFrame

log = logging.getLogger("ciuicflow.kvflow.receiver")

MALFORMED = object()      # what a safe deserializer returns for bytes that are not the expected message
TOMBSTONES = 4096


class InChunk:
    """A received chunk: bytes of one part from ``offset``, or, packed, several whole parts back to back
    (``info`` and then ``more``)."""
    __slots__ = ("part", "offset", "data", "info", "crc", "part_nbytes", "more")

    def __init__(self, part, offset, data, info, crc, part_nbytes, more=()):
        self.part = part
        self.offset = offset
        self.data = data
        self.info = info
        self.crc = crc
        self.part_nbytes = part_nbytes
        self.more = tuple(more)

    @property
    def last_part(self) -> int:
        return self.part + len(self.more)

    @property
    def ends_part(self) -> bool:
        return bool(self.more) or self.offset + len(self.data) >= self.part_nbytes

    def spans(self):
        """(part, offset, PartInfo or None, start, length) of each part's bytes in ``data``."""
        first = len(self.data) - sum(m.nbytes for m in self.more)
        yield self.part, self.offset, self.info, 0, first
        start = first
        for m in self.more:
            yield m.index, 0, m, start, m.nbytes
            start += m.nbytes


def check_packed(c: pb.Chunk, n: int) -> Optional[str]:
    """Why the packed chunk ``c`` with ``n`` bytes of data is malformed (None: it is not)."""
    if c.offset or not c.HasField("info"):
        return f"packed chunk of part {c.part} does not start a part"
    total = c.info.nbytes
    for k, m in enumerate(c.more, 1):
        err = check_part_info(m, c.part + k)
        if err:
            return err
        total += m.nbytes
    if total != n:
        return f"packed chunk of parts {c.part}..{c.part + len(c.more)} has {n} bytes, its parts {total}"
    return None


class InTransfer:
    def __init__(self, key: str, source: str, uuid: str, priority: str, payload_kind: str, lease_s: float,
                 deadline: Optional[float]):
        self.key = key
        self.source = source
        self.uuid = uuid
        self.priority = priority
        self.payload_kind = payload_kind
        self.lease_s = lease_s
        self.deadline = deadline
        self.chunks: List[InChunk] = []
        self.bytes = 0
        self.total: Optional[int] = None
        self.num_parts: Optional[int] = None
        self.complete = False
        self.failed: Optional[Tuple[grpc.StatusCode, str]] = None
        now = time.monotonic()
        self.created = now
        self.last_activity = now
        self.completed_at: Optional[float] = None
        self.readers = 0
        self.attached = None              # the link stream feeding it, None while its sender is away
        self.detached_at: Optional[float] = None
        self.truncations: List[Tuple[int, int]] = []    # (generation, seq)
        self.generation = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def changed(self, timeout: Optional[float]) -> bool:
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def expected_next(self) -> Tuple[int, int, Optional[int]]:
        """(part, offset, part_nbytes or None when a new part starts) of the next chunk."""
        if not self.chunks:
            return 0, 0, None
        last = self.chunks[-1]
        if last.ends_part:
            return last.last_part + 1, 0, None
        return last.part, last.offset + len(last.data), last.part_nbytes


class Store:
    """Received transfers by key, with leases; memory counted in the sidecar's budget."""

    def __init__(self, sidecar):
        self.sc = sidecar
        self.entries: Dict[str, InTransfer] = {}
        self.tombstones: "collections.OrderedDict[str, tuple]" = collections.OrderedDict()
        self._arrival = asyncio.Event()
        self.completed = 0
        self.expired = 0
        self.collected = 0
        self.spool = None

    # ------------------------------------------------------------------ membership
    def add(self, entry: InTransfer) -> None:
        self.entries[entry.key] = entry
        self.tombstones.pop(entry.key, None)
        if self.spool:
            self.spool.create(entry)
        self._arrival.set()
        self._arrival = asyncio.Event()

    def _tombstone(self, entry: InTransfer, reason: str, code=None, message: str = "") -> None:
        self.tombstones[entry.key] = (reason, entry.uuid, code, message)
        self.tombstones.move_to_end(entry.key)
        while len(self.tombstones) > TOMBSTONES:
            self.tombstones.popitem(last=False)

    def drop(self, entry: InTransfer, reason: str) -> None:
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        self._release(entry)
        if self.spool:
            self.spool.delete(entry)
        code, message = entry.failed if entry.failed else (None, "")
        self._tombstone(entry, reason, code, message)
        entry.notify()

    def _release(self, entry: InTransfer) -> None:
        if entry.bytes:
            self.sc.budget.release(entry.source, entry.bytes)
        entry.bytes = 0
        entry.chunks = []

    def truncate(self, entry: InTransfer, seq: int) -> None:
        dropped = entry.chunks[seq:]
        n = sum(len(c.data) for c in dropped)
        del entry.chunks[seq:]
        entry.bytes -= n
        self.sc.budget.release(entry.source, n)
        entry.generation += 1
        entry.truncations.append((entry.generation, seq))
        if self.spool:
            self.spool.rewrite(entry)

    def fail(self, entry: InTransfer, code: grpc.StatusCode, message: str) -> None:
        if entry.failed or entry.complete:
            return
        log.info("incoming transfer %r from %s failed: %s %s", entry.key, entry.source, code.name, message)
        entry.failed = (code, message)
        entry.last_activity = time.monotonic()
        self._release(entry)
        if self.spool:
            self.spool.delete(entry)
        self.sc.metrics.transfers.labels(entry.source, entry.priority, "recv", code.name).inc()
        entry.notify()

    def mark_complete(self, entry: InTransfer) -> None:
        entry.complete = True
        entry.completed_at = time.monotonic()
        self.completed += 1
        if self.spool:
            self.spool.complete(entry)
        self.sc.metrics.transfers.labels(entry.source, entry.priority, "recv", "OK").inc()
        self.sc.metrics.latency.labels(entry.priority, "recv").observe(entry.completed_at - entry.created)
        entry.notify()

    def collect(self, entry: InTransfer) -> None:
        self.collected += 1
        self.drop(entry, "collected")

    async def wait_for(self, key: str, deadline: Optional[float]) -> Optional[InTransfer]:
        while True:
            entry = self.entries.get(key)
            if entry is not None:
                return entry
            event = self._arrival
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return None
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return None

    # ------------------------------------------------------------------ leases, deadlines, lost senders
    def sweep(self) -> None:
        now = time.monotonic()
        cfg = self.sc.cfg
        for entry in list(self.entries.values()):
            if not entry.complete and not entry.failed:
                if entry.deadline is not None and now > entry.deadline:
                    self.fail(entry, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"transfer {entry.key!r} from {entry.source!r} missed its deadline "
                              f"({len(entry.chunks)} chunks arrived)")
                elif entry.attached is None and entry.detached_at is not None \
                        and now - entry.detached_at > cfg.resume_timeout_s:
                    self.fail(entry, grpc.StatusCode.UNAVAILABLE,
                              f"sender {entry.source!r} went away mid-transfer and did not come back "
                              f"within {cfg.resume_timeout_s:g}s")
            if entry.readers:
                continue
            lease = entry.lease_s or cfg.lease_s
            since = entry.completed_at if entry.complete else entry.last_activity
            if now - since > lease:
                if entry.complete:
                    self.expired += 1
                    self.sc.metrics.leases_expired.inc()
                    log.info("lease of %r from %s expired uncollected", entry.key, entry.source)
                self.drop(entry, "expired")

    def snapshot(self) -> dict:
        return {
            "transfers": len(self.entries),
            "complete": sum(1 for e in self.entries.values() if e.complete),
            "bytes": sum(e.bytes for e in self.entries.values()),
            "completed": self.completed,
            "collected": self.collected,
            "expired": self.expired,
            "keys": sorted(self.entries)[:100],
        }


class TokenBucket:
    """Emulated slow link: incoming peer bytes are read at most ``rate`` bytes/s."""

    def __init__(self, rate: float, burst: int = 64 << 10):
        self.rate = float(rate)
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def consume(self, n: int) -> None:
        async with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class PeerService:
    """``KVFlowPeer.Link``: one stream per sending peer."""

    def __init__(self, sidecar):
        self.sc = sidecar
        self.store: Store = sidecar.store
        self.bucket = TokenBucket(sidecar.cfg.link_rate) if sidecar.cfg.link_rate else None
        self.active_links: Dict[str, int] = collections.Counter()

    async def _check_auth(self, context) -> str:
        cfg = self.sc.cfg
        md = dict(context.invocation_metadata())
        if cfg.token and md.get(AUTH_METADATA) != f"Bearer {cfg.token}":
            self.sc.metrics.rejected.labels("UNAUTHENTICATED").inc()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "peer link needs a valid token "
                                "(metadata 'authorization: Bearer TOKEN')")
        source = md.get(PEER_METADATA, "")
        if not source:
            self.sc.metrics.rejected.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"peer link needs metadata '{PEER_METADATA}'")
        if source not in cfg.peers and not cfg.allow_unknown_peers:
            self.sc.metrics.rejected.labels("PERMISSION_DENIED").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"unknown peer {source!r}: not named by --peer (or use --allow-unknown-peers)")
        return source

    async def Link(self, request_iterator, context):
        source = await self._check_auth(context)
        async for reply in self.serve_link(source, request_iterator, context):
            yield reply

    async def DataPlane(self, request: pb.DataPlaneRequest, context) -> pb.DataPlaneReply:
        """The TCP data plane's port and a one-time ticket for this (authenticated) sender; port 0: none."""
        source = await self._check_auth(context)
        plane = self.sc.data_plane
        if plane is None:
            return pb.DataPlaneReply()
        return pb.DataPlaneReply(port=plane.port, ticket=plane.tickets.issue(source))

    async def serve_link(self, source: str, request_iterator, context):
        """One sender's stream of frames (from ``Link`` or the TCP data plane); yields the replies."""
        if self.sc.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
        link_id = object()
        attached: Dict[int, InTransfer] = {}
        self.active_links[source] += 1
        frames = 0
        try:
            async for frame in request_iterator:
                frames += 1
                if frames % 256 == 0:       # forget finished transfers of this long-lived stream
                    for tid, entry in list(attached.items()):
                        if entry.complete or entry.failed or self.store.entries.get(entry.key) is not entry:
                            del attached[tid]
                if frame is MALFORMED:
                    self.sc.metrics.rejected.labels("INVALID_ARGUMENT").inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed PeerFrame")
                kind = frame.WhichOneof("msg")
                data = frame.data if isinstance(frame, ChunkFrame) else None   # the TCP plane's zero-copy frames
                if self.bucket is not None:
                    await self.bucket.consume(len(data) + 64 if data is not None else frame.ByteSize())
                if kind == "chunk":
                    for reply in self._on_chunk(source, frame.chunk, attached, data):
                        yield reply
                elif kind == "open":
                    yield self._on_open(source, frame.open, attached, link_id)
                elif kind == "commit":
                    reply = self._on_commit(frame.commit, attached)
                    if reply is not None:
                        yield reply
                elif kind == "abort":
                    entry = attached.pop(frame.abort.tid, None)
                    if entry is not None:
                        code = _status(frame.abort.code)
                        self.store.fail(entry, code, f"sender {source!r}: {frame.abort.message}")
                else:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty PeerFrame")
        finally:
            self.active_links[source] -= 1
            now = time.monotonic()
            for entry in attached.values():
                if entry.attached is link_id:
                    entry.attached = None
                    entry.detached_at = now

    # ------------------------------------------------------------------ frames
    def _on_open(self, source: str, o: pb.TransferOpen, attached, link_id) -> pb.PeerReply:
        def refuse(code: grpc.StatusCode, message: str) -> pb.PeerReply:
            self.sc.metrics.rejected.labels(code.name).inc()
            return pb.PeerReply(state=pb.TransferState(tid=o.tid, error_code=code.value[0], error=message))

        err = check_key(o.key)
        priority = priority_from_pb(o.priority)
        if err:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, err)
        if priority is None:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, f"unknown priority {o.priority}")
        if self.sc.shutting_down:
            return refuse(grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
        store = self.store
        entry = store.entries.get(o.key)
        if entry is not None:
            same = entry.uuid == o.uuid
            if entry.failed is not None and (same or entry.source == source):
                store.drop(entry, "replaced")
                entry = None
            elif same or (entry.source == source and not entry.complete and o.resume):
                pass
            elif entry.source == source and not entry.complete and entry.attached is None:
                store.drop(entry, "replaced")     # a new attempt that does not resume: start over
                entry = None
            else:
                who = "this peer" if entry.source == source else f"peer {entry.source!r}"
                state = "completed and not yet collected" if entry.complete else "in progress"
                return refuse(grpc.StatusCode.ALREADY_EXISTS,
                              f"duplicate key {o.key!r}: a transfer from {who} is {state}")
        if entry is None:
            tomb = store.tombstones.get(o.key)
            if tomb is not None and tomb[0] == "collected" and tomb[1] == o.uuid:
                return pb.PeerReply(state=pb.TransferState(tid=o.tid, complete=True))
            deadline = time.monotonic() + o.deadline_s if o.deadline_s > 0 else None
            entry = InTransfer(o.key, source, o.uuid, priority, o.payload_kind, o.lease_s, deadline)
            store.add(entry)
        complete = entry.complete and entry.uuid == o.uuid
        entry.uuid = o.uuid
        entry.attached = link_id
        entry.detached_at = None
        entry.last_activity = time.monotonic()
        attached[o.tid] = entry
        return pb.PeerReply(state=pb.TransferState(
            tid=o.tid, held_chunks=len(entry.chunks), held_crc32c=[c.crc for c in entry.chunks],
            complete=complete, durable=store.spool is not None))

    def _on_chunk(self, source: str, c: pb.Chunk, attached, data=None):
        def ack(code, error: grpc.StatusCode = None, message: str = "") -> pb.PeerReply:
            return pb.PeerReply(ack=pb.Ack(tid=c.tid, seq=c.seq, sn=c.sn, code=code,
                                           error_code=error.value[0] if error else 0, message=message))

        entry = attached.get(c.tid)
        if entry is None:
            yield ack(pb.ACK_FAILED, grpc.StatusCode.FAILED_PRECONDITION, f"chunk for unknown transfer {c.tid}")
            return
        if entry.failed:
            yield ack(pb.ACK_FAILED, *entry.failed)
            return
        if entry.complete:
            yield ack(pb.ACK_OK)
            return
        if data is None:
            data = c.data
        held = len(entry.chunks)
        if c.seq > held:
            yield ack(pb.ACK_OUT_OF_ORDER)        # an earlier chunk is missing; the sender goes back
            return
        if c.seq < held and entry.chunks[c.seq].crc == c.crc32c:
            yield ack(pb.ACK_OK)                  # a duplicate of a chunk held already
            return
        if crc32c.crc32c(data) != c.crc32c:
            self.sc.metrics.retransmits.labels(source, "checksum_in").inc()
            yield ack(pb.ACK_CORRUPT, message="checksum mismatch")
            return
        if c.seq < held:
            self.store.truncate(entry, c.seq)      # resumed with different content from here on
        part, offset, part_nbytes = entry.expected_next()
        error = None
        if c.part != part or c.offset != offset:
            error = f"chunk out of order: part {c.part} offset {c.offset}, expected part {part} offset {offset}"
        elif offset == 0:
            if not c.HasField("info"):
                error = f"first chunk of part {part} has no PartInfo"
            else:
                error = check_part_info(c.info, part)
                part_nbytes = c.info.nbytes
        if error is None and c.more:
            error = check_packed(c, len(data))
        elif error is None and (offset + len(data) > part_nbytes or (not data and part_nbytes)):
            error = f"chunk of part {part} at offset {offset} with {len(data)} bytes overruns {part_nbytes}"
        if error is not None:
            self.store.fail(entry, grpc.StatusCode.INVALID_ARGUMENT, error)
            yield ack(pb.ACK_FAILED, grpc.StatusCode.INVALID_ARGUMENT, error)
            return
        if not self.sc.budget.try_reserve(source, len(data)):
            yield ack(pb.ACK_BUSY, message="receiver over its memory cap")
            return
        chunk = InChunk(c.part, c.offset, data, c.info if offset == 0 else None, c.crc32c, part_nbytes, c.more)
        entry.chunks.append(chunk)
        entry.bytes += len(data)
        entry.last_activity = time.monotonic()
        if self.store.spool:
            self.store.spool.append(entry, chunk)
        self.sc.metrics.bytes.labels(source, entry.priority, "recv").inc(len(data))
        self.sc.metrics.chunks.labels(source, entry.priority, "recv").inc()
        entry.notify()
        yield ack(pb.ACK_OK)
        if entry.total is not None and len(entry.chunks) >= entry.total:
            yield self._finish(entry, c.tid)

    def _on_commit(self, commit: pb.Commit, attached) -> Optional[pb.PeerReply]:
        entry = attached.get(commit.tid)
        if entry is None:
            return pb.PeerReply(commit=pb.CommitAck(tid=commit.tid, error_code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                                    message=f"commit for unknown transfer {commit.tid}"))
        if entry.failed:
            return pb.PeerReply(commit=pb.CommitAck(tid=commit.tid, error_code=entry.failed[0].value[0],
                                                    message=entry.failed[1]))
        if entry.complete:
            return pb.PeerReply(commit=pb.CommitAck(tid=commit.tid))
        entry.total = commit.total_chunks
        entry.num_parts = commit.num_parts
        if len(entry.chunks) > entry.total:
            self.store.truncate(entry, entry.total)
        if len(entry.chunks) == entry.total:
            return self._finish(entry, commit.tid)
        return None

    def _finish(self, entry: InTransfer, tid: int) -> pb.PeerReply:
        error = None
        if entry.num_parts:
            last = entry.chunks[-1] if entry.chunks else None
            if last is None or last.last_part != entry.num_parts - 1 or not last.ends_part:
                error = f"commit of {entry.num_parts} parts, but the chunks do not end part {entry.num_parts - 1}"
        elif entry.chunks:
            error = "commit of 0 parts after chunks"
        if error:
            self.store.fail(entry, grpc.StatusCode.INVALID_ARGUMENT, error)
            return pb.PeerReply(commit=pb.CommitAck(tid=tid, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                    message=error))
        self.store.mark_complete(entry)
        return pb.PeerReply(commit=pb.CommitAck(tid=tid))


def _status(value: int) -> grpc.StatusCode:
    code = status_code(value)
    return grpc.StatusCode.UNKNOWN if code == grpc.StatusCode.OK else code
