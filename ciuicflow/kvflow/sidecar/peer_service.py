"""``KVFlowPeer``: the receiving side of peer streams (``Link``, and the TCP data plane through ``serve``)
and ``DataPlane``, which hands out the data plane's port and tickets.

Chunks are accepted strictly in order per transfer (seq == chunks held), after their crc32c is checked;
an out-of-order chunk is dropped (the sender goes back), a corrupt one answered ``ACK_CORRUPT``, one over
the memory cap ``ACK_BUSY``. A completed transfer waits in the store for ``Recv``.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Dict, Optional

import crc32c
import grpc

from ..proto import kvflow_pb2 as pb
from ..proto import kvflow_pb2_grpc as pb_grpc
from ..proto.codec import MALFORMED, ChunkFrame
from ..core.identity import AuthError, PeerPolicy, certificate_names
from ..core.limits import Labels, seconds
from ..proto.messages import (AUTH_METADATA, MAX_PACKED_PARTS, PEER_METADATA, check_key, check_part_info,
                              priority_from_pb, status_code)
from .spool import SpoolError
from .store import InChunk, InTransfer, Store

log = logging.getLogger("ciuicflow.kvflow.peer_service")

MAX_DEADLINE_S = 86400.0        # a peer's deadline beyond this is cut to it
STREAMS_PER_PEER = 8            # concurrent streams of one peer (a sender keeps one; reconnects overlap)


def too_many_parts(c: pb.Chunk) -> Optional[str]:
    """Why ``c`` has too many parts (None: it has not). Checked before anything else: a frame carries
    millions of zero-byte part descriptions, which no budget could hold (proto.codec reads at most one
    more than this bound of them)."""
    if 1 + len(c.more) > MAX_PACKED_PARTS:
        return f"packed chunk of more than {MAX_PACKED_PARTS} parts"
    return None


def check_packed(c: pb.Chunk, n: int) -> Optional[str]:
    """Why the packed chunk ``c`` with ``n`` bytes of data is malformed (None: it is not)."""
    if c.offset or not c.HasField("info"):
        return f"packed chunk of part {c.part} does not start a part"
    if too_many_parts(c):
        return too_many_parts(c)
    total = c.info.nbytes
    for k, m in enumerate(c.more, 1):
        err = check_part_info(m, c.part + k)
        if err:
            return err
        total += m.nbytes
    if total != n:
        return f"packed chunk of parts {c.part}..{c.part + len(c.more)} has {n} bytes, its parts {total}"
    return None


def commit_error(entry: InTransfer, commit: pb.Commit) -> Optional[str]:
    """Why ``commit`` contradicts what was sent of ``entry`` (None: it does not). A sender commits once per
    open, after every chunk went out: never fewer chunks than this side holds (a commit must not discard
    chunks that were sent and acknowledged, e.g. complete an empty transfer after a held chunk), never
    other numbers than its earlier commit on the same open, never chunks without parts."""
    held = len(entry.chunks)
    if commit.total_chunks < held:
        return f"commit of {commit.total_chunks} chunks, but {held} were sent and are held here"
    if entry.total is not None and (entry.total, entry.num_parts) != (commit.total_chunks, commit.num_parts):
        return (f"commit of {commit.total_chunks} chunks and {commit.num_parts} parts after a commit of "
                f"{entry.total} and {entry.num_parts}")
    if commit.total_chunks and not commit.num_parts:
        return f"commit of {commit.total_chunks} chunks and 0 parts"
    return None


class PeerService(pb_grpc.KVFlowPeerServicer):
    """Peer streams into ``store``, memory from ``budget``. Senders are authenticated by ``policy``
    (core.identity.PeerPolicy: token, per-peer secrets, certificate names, known peers);
    ``shutting_down()`` refuses new work. ``throttle`` (tests: an emulated slow link) is awaited with each
    frame's size before it is handled. ``data_plane``: the TCP data plane whose tickets ``DataPlane`` hands
    out (None: none).

    What a peer can make it hold is bounded: ``max_open_transfers`` transfers per peer, leases cut to
    ``max_lease_s``, STREAMS_PER_PEER streams, every held chunk's cost (descriptions included) in the
    budget, and peers counted (metrics, budget) under ``labels`` (a bounded set of names)."""

    def __init__(self, store: Store, budget, metrics, *, policy: PeerPolicy, shutting_down: Callable[[], bool],
                 throttle: Optional[Callable[[int], Awaitable[None]]] = None, labels: Optional[Labels] = None,
                 max_open_transfers: int = 1024, max_lease_s: float = 600.0):
        self.store = store
        self.budget = budget
        self.metrics = metrics
        self.policy = policy
        self.labels = labels or Labels(policy.known_peers)
        self.max_open_transfers = max_open_transfers
        self.max_lease_s = max_lease_s
        self.streams: Dict[str, int] = {}          # account -> streams open
        self.shutting_down = shutting_down
        self.throttle = throttle
        self.data_plane = None
        self.identity = None        # discovery: IdentifyRequest -> IdentifyReply (discovery/service.py)

    def use_data_plane(self, plane) -> None:
        """The TCP data plane started beside this service: ``DataPlane`` hands out its port and tickets."""
        self.data_plane = plane

    def use_identity(self, identity) -> None:
        """Discovery started: ``Identify`` answers with ``identity(request)``."""
        self.identity = identity

    async def _check_auth(self, context) -> str:
        """The authenticated name of the peer on this call (its credential binds it: core.identity)."""
        md = dict(context.invocation_metadata())
        cert_names = certificate_names(context.auth_context()) if self.policy.mutual_tls else None
        try:
            return self.policy.authenticate(md.get(PEER_METADATA, ""), md.get(AUTH_METADATA), cert_names)
        except AuthError as exc:
            self.metrics.rejected.labels(exc.code.name).inc()
            await context.abort(exc.code, exc.message)

    async def Link(self, request_iterator, context):
        """The gRPC transport's receiving half."""
        source = await self._check_auth(context)
        async for reply in self.serve(source, request_iterator, context):
            yield reply

    async def DataPlane(self, request: pb.DataPlaneRequest, context) -> pb.DataPlaneReply:
        """The TCP data plane's port and a one-time ticket for this (authenticated) sender; port 0: none."""
        source = await self._check_auth(context)
        plane = self.data_plane
        if plane is None:
            return pb.DataPlaneReply()
        return pb.DataPlaneReply(port=plane.port, ticket=plane.tickets.issue(source))

    async def Identify(self, request: pb.IdentifyRequest, context) -> pb.IdentifyReply:
        """Discovery: prove this sidecar's name to a sidecar that found it in the registry (needs no
        credential: the answer proves, it grants nothing; discovery/identify.py)."""
        if self.identity is None or request is MALFORMED:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this sidecar is not in a registry")
        return self.identity(request)

    async def serve(self, source: str, request_iterator, context):
        """One sender's stream of frames (from any transport's receiving half); yields the replies."""
        if self.shutting_down():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
        account = self.labels(source)
        if self.streams.get(account, 0) >= STREAMS_PER_PEER:
            self.metrics.rejected.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"peer {source!r} has {STREAMS_PER_PEER} streams open already")
        self.streams[account] = self.streams.get(account, 0) + 1
        stream_id = object()
        attached: Dict[int, InTransfer] = {}
        frames = 0
        try:
            async for frame in request_iterator:
                frames += 1
                if frames % 256 == 0:       # forget finished transfers of this long-lived stream
                    for tid, entry in list(attached.items()):
                        if entry.complete or entry.failed or not self.store.holds(entry):
                            del attached[tid]
                if frame is MALFORMED:
                    self.metrics.rejected.labels("INVALID_ARGUMENT").inc()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed PeerFrame")
                kind = frame.WhichOneof("msg")
                data = frame.data if isinstance(frame, ChunkFrame) else None   # the TCP plane's zero-copy frames
                if self.throttle is not None:
                    await self.throttle(len(data) + 64 if data is not None else frame.ByteSize())
                if kind == "chunk":
                    for reply in self._on_chunk(account, frame.chunk, attached, data):
                        yield reply
                elif kind == "open":
                    yield self._on_open(source, account, frame.open, attached, stream_id)
                elif kind == "commit":
                    reply = self._on_commit(frame.commit, attached)
                    if reply is not None:
                        yield reply
                elif kind == "query":
                    yield self._on_query(source, frame.query)
                elif kind == "abort":
                    entry = attached.pop(frame.abort.tid, None)
                    if entry is not None:
                        code = status_code(frame.abort.code)
                        if code == grpc.StatusCode.OK:      # an abort always reports a failure
                            code = grpc.StatusCode.UNKNOWN
                        self.store.fail(entry, code, f"sender {source!r}: {frame.abort.message}")
                else:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty PeerFrame")
        finally:
            self.streams[account] -= 1
            if not self.streams[account]:
                del self.streams[account]
            for entry in attached.values():
                entry.detach(stream_id)

    # ------------------------------------------------------------------ frames
    def _on_open(self, source: str, account: str, o: pb.TransferOpen, attached, stream_id) -> pb.PeerReply:
        def refuse(code: grpc.StatusCode, message: str) -> pb.PeerReply:
            self.metrics.rejected.labels(code.name).inc()
            return pb.PeerReply(state=pb.TransferState(tid=o.tid, error_code=code.value[0], error=message))

        err = check_key(o.key)
        priority = priority_from_pb(o.priority)
        if err:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, err)
        if priority is None:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, f"unknown priority {o.priority}")
        if self.shutting_down():
            return refuse(grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
        try:
            lease_s = seconds(o.lease_s, maximum=self.max_lease_s, what="lease_s")
            deadline_s = seconds(o.deadline_s, maximum=MAX_DEADLINE_S, what="deadline_s")
        except ValueError as exc:
            return refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        store = self.store
        entry = store.get(source, o.key)        # only this (authenticated) source's transfers
        if o.tid not in attached and not (entry is not None and entry.attached is stream_id) \
                and len(attached) >= self.max_open_transfers:
            return refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{len(attached)} transfers open on this stream (at most {self.max_open_transfers})")
        if entry is not None:
            if entry.failed is not None:
                store.drop(entry, "replaced")
                entry = None
            elif entry.uuid == o.uuid or (not entry.complete and o.resume):
                pass
            elif not entry.complete and entry.attached is None:
                store.drop(entry, "replaced")     # a new attempt that does not resume: start over
                entry = None
            else:
                state = "completed and not yet collected" if entry.complete else "in progress"
                return refuse(grpc.StatusCode.ALREADY_EXISTS,
                              f"duplicate key {o.key!r}: a transfer from this peer is {state}")
        if entry is None:
            tomb = store.tombstone(o.key, source)
            if tomb is not None and tomb[0] == "collected" and tomb[1] == o.uuid:
                return pb.PeerReply(state=pb.TransferState(tid=o.tid, complete=True, durable=store.spool is not None,
                                                           queries=True))
            if store.per_account[account] >= self.max_open_transfers:
                return refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"peer {source!r} has {self.max_open_transfers} transfers here already "
                              "(in progress or not yet collected)")
            deadline = time.monotonic() + deadline_s if deadline_s > 0 else None
            entry = InTransfer(o.key, source, o.uuid, priority, o.payload_kind, lease_s, deadline, account)
            try:
                store.add(entry)
            except SpoolError as exc:
                return refuse(exc.code, exc.message)
        complete = entry.complete and entry.uuid == o.uuid
        for tid, other in list(attached.items()):
            if other is entry and tid != o.tid:
                del attached[tid]           # one tid per transfer on a stream: re-opens do not pile up
        entry.attach(stream_id, o.uuid)     # not complete: its sender commits again on this open (commit_error)
        attached[o.tid] = entry
        return pb.PeerReply(state=pb.TransferState(
            tid=o.tid, held_chunks=len(entry.chunks), held_crc32c=[c.crc for c in entry.chunks],
            complete=complete, durable=store.spool is not None, queries=True))

    def _on_chunk(self, account: str, c: pb.Chunk, attached, data=None):
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
        error = too_many_parts(c)
        if error is not None:
            self.store.fail(entry, grpc.StatusCode.INVALID_ARGUMENT, error)
            yield ack(pb.ACK_FAILED, grpc.StatusCode.INVALID_ARGUMENT, error)
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
            self.metrics.retransmits.labels(account, "checksum_in").inc()
            yield ack(pb.ACK_CORRUPT, message="checksum mismatch")
            return
        if c.seq < held:
            self.store.truncate(entry, c.seq)      # resumed with different content from here on
            if entry.failed:
                yield ack(pb.ACK_FAILED, *entry.failed)
                return
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
        chunk = InChunk(c.part, c.offset, data, c.info if offset == 0 else None, c.crc32c, part_nbytes, c.more)
        if not self.store.hold(entry, chunk):
            yield ack(pb.ACK_BUSY, message="receiver over its memory cap")
            return
        entry.touch()
        if not self.store.persist(entry, chunk):
            yield ack(pb.ACK_FAILED, *entry.failed)
            return
        self.metrics.bytes.labels(account, entry.priority, "recv").inc(len(data))
        self.metrics.chunks.labels(account, entry.priority, "recv").inc()
        entry.notify()
        yield ack(pb.ACK_OK)
        if entry.total is not None and len(entry.chunks) >= entry.total:
            yield self._finish(entry, c.tid)

    def _on_query(self, source: str, query: pb.Query) -> pb.PeerReply:
        """Which of this sender's committed transfers are held here, collected, expired or unknown (lost):
        a sender keeps a committed transfer, to send it again, until it learns that its consumer has it."""
        reply = pb.QueryReply()
        for item in query.items[:1024]:
            entry = self.store.get(source, item.key)
            if entry is not None and entry.uuid == item.uuid:
                holding = pb.HOLDING_GONE if entry.failed else pb.HOLDING_HELD
            else:
                tomb = self.store.tombstone(item.key, source)
                if tomb is not None and tomb[1] == item.uuid:
                    holding = {"collected": pb.HOLDING_COLLECTED, "expired": pb.HOLDING_EXPIRED}.get(
                        tomb[0], pb.HOLDING_GONE)
                else:       # another transfer of the key since, or none at all (this receiver lost it)
                    holding = pb.HOLDING_GONE if entry is not None else pb.HOLDING_UNKNOWN
            reply.tid.append(item.tid)
            reply.holding.append(holding)
        return pb.PeerReply(query=reply)

    def _commit_ack(self, tid: int, entry: Optional[InTransfer] = None, code=None, message: str = "") -> pb.PeerReply:
        ack = pb.CommitAck(tid=tid, error_code=code.value[0] if code else 0, message=message)
        if entry is not None and code is None:
            ack.lease_s = entry.lease_s or self.store.lease_s
            ack.durable = self.store.spool is not None
            ack.queries = True
        return pb.PeerReply(commit=ack)

    def _on_commit(self, commit: pb.Commit, attached) -> Optional[pb.PeerReply]:
        entry = attached.get(commit.tid)
        if entry is None:
            return self._commit_ack(commit.tid, None, grpc.StatusCode.FAILED_PRECONDITION,
                                    f"commit for unknown transfer {commit.tid}")
        if entry.failed:
            return self._commit_ack(commit.tid, None, *entry.failed)
        if entry.complete:
            if not self.store.holds(entry):     # collected or expired since: the sender must not wait for it
                return self._commit_ack(commit.tid, None, grpc.StatusCode.ABORTED,
                                        f"transfer {entry.key!r} is no longer held here")
            return self._commit_ack(commit.tid, entry)
        error = commit_error(entry, commit)
        if error:
            self.store.fail(entry, grpc.StatusCode.INVALID_ARGUMENT, error)
            return self._commit_ack(commit.tid, None, grpc.StatusCode.INVALID_ARGUMENT, error)
        entry.committed(commit.total_chunks, commit.num_parts)
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
            return self._commit_ack(tid, None, grpc.StatusCode.INVALID_ARGUMENT, error)
        if not self.store.mark_complete(entry):     # with a spool: durable before this acknowledgement
            return self._commit_ack(tid, None, *entry.failed)
        return self._commit_ack(tid, entry)
