"""One outgoing transfer's protocol state: pure logic, clock injected (as scheduler.py and congestion.py).

States, per connection to the peer:

    NEW      nothing said about the transfer on the current connection (after creation and every disconnect)
    OPENING  its TransferOpen went out; chunks wait for the receiver's TransferState (a resume or a re-open)
    OPEN     chunks may go; the Commit goes once the transfer is closed and every chunk went out
    DONE     the receiver holds all of it (CommitAck, or a TransferState saying complete)
    FAILED   ``failure`` says why; ``failure.tell_peer``: the receiver should be sent an Abort

Events (methods): ``add_chunk`` and ``close`` (the local client's data), ``open`` (NEW -> OPEN or OPENING: a
first, non-resuming open goes straight to OPEN, the receiver starts it empty), ``on_state``
(TransferState), ``take_chunk`` (the next chunk goes out), ``on_ack`` (Ack: OK, CORRUPT and BUSY rewind to
the chunk, FAILED ends it), ``commit`` / ``on_commit``, ``disconnected`` (back to NEW), ``check_time``
(deadline, peer gone too long, no progress too long, the local sender silent too long) and ``fail``;
``revive`` (DONE -> NEW: a receiver without spool lost the transfer before its consumer had it, and it is
sent again).

On OPEN with the receiver's checksums (a resume), chunks it already holds with the same content count as
acknowledged without being sent. A durable receiver (one that spools to disk) keeps what it acknowledged
across its restarts, so ``on_ack`` then frees acknowledged chunks' bytes; a receiver that later reports
fewer chunks than were freed fails the transfer with DATA_LOSS.

The owner (``PeerSender``) writes the frames, keeps the futures the local API waits on, and settles a
transfer once it is DONE or FAILED.
"""
from __future__ import annotations

import collections
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto.messages import priority_to_pb, status_code

NEW, OPENING, OPEN, DONE, FAILED = "new", "opening", "open", "done", "failed"


class TransferFailed(Exception):
    """A transfer's (or a request's) failure: the gRPC status that reports it, and why."""

    def __init__(self, code: grpc.StatusCode, message: str, tell_peer: bool = False):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.tell_peer = tell_peer


@dataclass
class OutChunk:
    part: int
    offset: int
    data: bytes
    crc: int
    info: Optional[pb.PartInfo]
    more: tuple = ()            # a packed chunk: the whole parts after the first (see pb.Chunk.more)
    cost: int = 0               # what the owner reserved for it in its memory budget (0: its bytes)


@dataclass(frozen=True)
class Limits:
    max_retransmits: int = 8        # checksum failures of one chunk before DATA_LOSS
    stall_timeout_s: float = 30.0   # no progress this long: the transfer fails
    resume_timeout_s: float = 30.0  # the peer unreachable this long: the transfer fails
    busy_backoff_s: float = 0.05    # a chunk the receiver refused (memory cap) waits this long to go again


class Transfer:
    def __init__(self, tid: int, key: str, dest: str, priority: str, *, flow: bool = True,
                 deadline: Optional[float] = None, payload_kind: str = "bytes", resume: bool = False,
                 lease_s: float = 0.0, limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
                 uuid: Optional[str] = None):
        self.tid, self.key, self.dest, self.priority, self.flow = tid, key, dest, priority, flow
        self.deadline = deadline                # absolute, on the clock
        self.payload_kind, self.resume, self.lease_s = payload_kind, resume, lease_s
        self.limits, self.clock = limits, clock
        self.uuid = uuid or uuidlib.uuid4().hex
        self.state = NEW
        self.failure: Optional[TransferFailed] = None
        self.chunks: List[OutChunk] = []
        self.closed = False
        self.num_parts = 0
        self.next_seq = 0                       # next chunk to send
        self.acked = 0                          # chunks the receiver holds (contiguous)
        self.released = 0                       # chunks whose bytes were freed (durable receiver only)
        self.remote_crcs: Optional[List[int]] = None
        self.commit_sent = False
        self.opens = 0
        self.retries: Dict[int, int] = collections.Counter()
        self.retransmits = 0
        self.resumed = 0
        self.bytes = 0
        self.sent_chunks = 0                    # high-water mark of chunks sent at least once
        self.sent_bytes = 0                     # their bytes
        self.buffered = 0                       # bytes the owner reserved in its memory budget
        self.busy_until = 0.0
        self.last_busy = False
        self.stall_logged = False
        self.created = clock()
        self.last_progress = self.created
        self.last_input = self.created          # the local client's last part (or its end)
        self.finished_at: Optional[float] = None
        self.durable = False                    # the receiver said it holds it on disk (CommitAck, TransferState)
        self.queryable = False                  # ... and that it answers Query frames (to keep it until collected)
        self.retain_until: Optional[float] = None   # DONE, kept for the receiver's sake until then (owner)

    # ------------------------------------------------------------------ queries
    @property
    def finished(self) -> bool:
        return self.state in (DONE, FAILED)

    @property
    def unsent_bytes(self) -> int:
        return self.bytes - self.sent_bytes

    def outstanding(self) -> bool:
        return self.acked < len(self.chunks) or self.closed

    def head_ready(self, now: float) -> bool:
        return self.state == OPEN and self.next_seq < len(self.chunks) and now >= self.busy_until

    def head_bytes(self, now: float) -> int:
        """Bytes of the chunk that may go next (at least 1), 0 when none may go now (for the scheduler)."""
        return max(len(self.chunks[self.next_seq].data), 1) if self.head_ready(now) else 0

    def reply(self) -> pb.SendReply:
        """What the local sender is told once the transfer is DONE."""
        return pb.SendReply(key=self.key, bytes=self.bytes, chunks=len(self.chunks), retransmits=self.retransmits,
                            resumed_chunks=self.resumed, seconds=self.finished_at - self.created, flow=self.flow)

    def commit_due(self) -> bool:
        return self.state == OPEN and self.closed and not self.commit_sent and self.next_seq >= len(self.chunks)

    # ------------------------------------------------------------------ the local client's data
    def add_chunk(self, chunk: OutChunk) -> None:
        self.last_input = self.clock()
        if self.acked == len(self.chunks):
            self.last_progress = self.last_input
        self.chunks.append(chunk)
        self.bytes += len(chunk.data)
        self._skip_held()

    def close(self, num_parts: int) -> None:
        self.closed = True
        self.num_parts = num_parts
        self.last_progress = self.last_input = self.clock()
        self._skip_held()

    # ------------------------------------------------------------------ the connection
    def open(self) -> pb.TransferOpen:
        """NEW -> OPEN (a first, non-resuming open) or OPENING; the frame that says so."""
        assert self.state == NEW, self.state
        self.opens += 1
        self.state = OPEN if self.opens == 1 and not self.resume else OPENING
        if self.state == OPEN:
            self.remote_crcs = None
            self._skip_held()
        remaining = max(self.deadline - self.clock(), 1e-3) if self.deadline else 0.0
        return pb.TransferOpen(tid=self.tid, key=self.key, priority=priority_to_pb(self.priority),
                               deadline_s=remaining, payload_kind=self.payload_kind, uuid=self.uuid,
                               resume=self.resume, lease_s=self.lease_s)

    def disconnected(self) -> None:
        if not self.finished:
            self.state = NEW
        self.commit_sent = False
        self.remote_crcs = None

    def on_state(self, st: pb.TransferState) -> None:
        """The receiver's answer to the open: a refusal, complete already, or the chunks it holds."""
        if self.finished:
            return
        if st.error_code:
            self.fail(status_code(st.error_code), st.error, from_peer=True)
            return
        if st.complete:
            self.resumed = len(self.chunks)
            self.durable, self.queryable = st.durable, st.queries
            self._succeed()
            return
        self.last_progress = self.clock()
        if self.state == OPEN and not st.held_chunks:
            return          # the optimistic start is confirmed
        self.state = OPEN
        self.remote_crcs = list(st.held_crc32c)
        self.next_seq = 0
        self.acked = 0
        self._skip_held()

    def take_chunk(self) -> Tuple[int, OutChunk, bool]:
        """The chunk that goes now: (seq, chunk, whether it goes for the first time)."""
        seq = self.next_seq
        chunk = self.chunks[seq]
        self.next_seq += 1
        first = seq >= self.sent_chunks
        if first:
            self.sent_chunks = seq + 1
            self.sent_bytes += len(chunk.data)
        self._skip_held()
        return seq, chunk, first

    def on_ack(self, ack: pb.Ack, durable: bool = False) -> int:
        """The receiver's answer to chunk ``ack.seq``; returns the bytes freed (``durable`` receiver)."""
        if self.finished:
            return 0
        freed = 0
        code = ack.code
        if code == pb.ACK_OK:
            if ack.seq + 1 > self.acked:
                self.acked = ack.seq + 1
                self.last_progress = self.clock()
                self.last_busy = False
            if durable:
                freed = self._release_acked()
        elif code == pb.ACK_CORRUPT:
            self.retries[ack.seq] += 1
            self.retransmits += 1
            if self.retries[ack.seq] > self.limits.max_retransmits:
                self.fail(grpc.StatusCode.DATA_LOSS,
                          f"chunk {ack.seq} of {self.key!r} failed its checksum {self.retries[ack.seq]} times")
                return 0
            self._rewind(ack.seq)
        elif code == pb.ACK_BUSY:
            self.retransmits += 1
            self.last_busy = True
            self._rewind(ack.seq)
            self.busy_until = self.clock() + self.limits.busy_backoff_s
        elif code == pb.ACK_FAILED:
            self.fail(status_code(ack.error_code), ack.message, from_peer=True)
            return 0
        # ACK_OUT_OF_ORDER: an earlier chunk was refused; its own answer already rewound the transfer.
        self._skip_held()
        return freed

    def commit(self) -> pb.Commit:
        self.commit_sent = True
        return pb.Commit(tid=self.tid, total_chunks=len(self.chunks), num_parts=self.num_parts)

    def on_commit(self, ack: pb.CommitAck) -> None:
        if ack.error_code:
            self.fail(status_code(ack.error_code), ack.message, from_peer=True)
        else:
            self.durable, self.queryable = ack.durable, ack.queries
            self.lease_s = ack.lease_s or self.lease_s
            self._succeed()

    # ------------------------------------------------------------------ the owner's bookkeeping
    def reserved(self, n: int) -> None:
        """``n`` more bytes of the owner's memory budget are held for this transfer."""
        self.buffered += n

    def drop_bytes(self) -> int:
        """Let its chunks go: the bytes of the owner's budget they held (to release)."""
        n, self.buffered, self.chunks = self.buffered, 0, []
        return n

    def retain(self, until: float) -> None:
        """DONE, and kept (bytes and all) for the receiver's sake until ``until`` at most."""
        self.retain_until = until

    def end_busy(self) -> bool:
        """The receiver's back-off (ACK_BUSY) is over, if one was running: True once (its chunk may go)."""
        if not self.busy_until:
            return False
        self.busy_until = 0.0
        return True

    def stalled(self, now: float, after_s: float) -> bool:
        """True once: outstanding and without progress for ``after_s`` seconds (worth a log line)."""
        if self.stall_logged or not self.outstanding() or now - self.last_progress <= after_s:
            return False
        self.stall_logged = True
        return True

    def revive(self) -> None:
        """A DONE transfer its receiver lost (restarted without spool before its consumer had it): NEW
        again, to be sent again (the receiver reports what it holds, as on a resume)."""
        assert self.state == DONE, self.state
        self.state = NEW
        self.resume = True
        self.commit_sent = False
        self.remote_crcs = None
        self.next_seq = self.acked = 0
        self.finished_at = self.retain_until = None
        self.last_progress = self.clock()

    # ------------------------------------------------------------------ time
    def check_time(self, now: float, peer_down_since: Optional[float], peer_address: str = "") -> None:
        """Fail on a missed deadline, a peer unreachable (since ``peer_down_since``; None: connected) for
        the resume timeout, no progress for the stall timeout, or a local sender that sent nothing (and did
        not end the transfer) for the stall timeout."""
        if self.finished:
            return
        lim = self.limits
        if self.deadline is not None and now > self.deadline:
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, f"transfer {self.key!r} to {self.dest!r} missed its "
                      f"deadline ({self.acked} of {len(self.chunks)} chunks delivered)")
        elif peer_down_since is not None and now - max(peer_down_since, self.created) > lim.resume_timeout_s:
            self.fail(grpc.StatusCode.UNAVAILABLE,
                      f"peer {self.dest!r} at {peer_address} unreachable for {lim.resume_timeout_s:g}s")
        elif self.outstanding() and now - self.last_progress > lim.stall_timeout_s:
            if self.last_busy:
                self.fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"peer {self.dest!r} refused chunks (memory cap) for {lim.stall_timeout_s:g}s")
            else:
                self.fail(grpc.StatusCode.UNAVAILABLE, f"no progress to {self.dest!r} for {lim.stall_timeout_s:g}s")
        elif not self.closed and now - self.last_input > lim.stall_timeout_s:
            # a Send that never ends would hold its bytes here and at the receiver, and every FIFO transfer
            # behind it, for ever
            self.fail(grpc.StatusCode.CANCELLED, f"the local sender of {self.key!r} sent nothing for "
                      f"{lim.stall_timeout_s:g}s and did not end the transfer")

    # ------------------------------------------------------------------ outcomes
    def fail(self, code: grpc.StatusCode, message: str, from_peer: bool = False) -> bool:
        """FAILED (False when it had finished already). The receiver is told unless it reported the failure
        or never heard of the transfer on this connection."""
        if self.finished:
            return False
        self.failure = TransferFailed(code, message, tell_peer=not from_peer and self.state != NEW)
        self.state = FAILED
        self.finished_at = self.clock()
        return True

    def _succeed(self) -> None:
        self.state = DONE
        self.finished_at = self.clock()

    def _rewind(self, seq: int) -> None:
        if self.next_seq > seq:
            self.next_seq = seq

    def _release_acked(self) -> int:
        freed = 0
        while self.released < self.acked:
            chunk = self.chunks[self.released]
            freed += chunk.cost or len(chunk.data)
            self.chunks[self.released] = OutChunk(chunk.part, chunk.offset, b"", chunk.crc, None)
            self.released += 1
        self.buffered -= freed
        return freed

    def _skip_held(self) -> None:
        """Resume: count the chunks the receiver already holds with the same content as acknowledged."""
        if self.state != OPEN or self.remote_crcs is None:
            return
        if self.next_seq < self.released and len(self.remote_crcs) < self.released:
            self.fail(grpc.StatusCode.DATA_LOSS,
                      f"peer {self.dest!r} lost chunks it had acknowledged (holds {len(self.remote_crcs)}, "
                      f"{self.released} were freed here); send the transfer again")
            return
        limit = min(len(self.remote_crcs), len(self.chunks))
        while self.next_seq == self.acked and self.next_seq < limit:
            if self.chunks[self.next_seq].crc != self.remote_crcs[self.next_seq]:
                self.remote_crcs = self.remote_crcs[:self.next_seq]
                break
            if self.next_seq >= self.sent_chunks:
                self.sent_chunks = self.next_seq + 1
                self.sent_bytes += len(self.chunks[self.next_seq].data)
            self.next_seq += 1
            self.acked += 1
            self.resumed += 1
            self.last_progress = self.clock()
