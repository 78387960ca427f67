"""Sending side of a sidecar: one ``PeerLink`` per destination.

A link owns one long-lived bidirectional ``KVFlowPeer.Link`` stream to its peer, a ``Scheduler`` (which
transfer's chunk goes next) and a ``CongestionController`` (when, and how much in flight). Transfers are
opened with a handshake (the receiver answers with the chunks it already holds, so a transfer resumes
from the last acknowledged chunk after a reconnect), their chunks are acknowledged one by one (a checksum
mismatch is answered ``ACK_CORRUPT`` and the link goes back to that chunk), and a ``Commit`` closes them.

Transfers sent without ``x-ciuic-flow: enabled`` bypass the scheduler and the congestion controller: they
go FIFO and whole, as fast as gRPC takes them (the baseline).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

import grpc

from ..proto.messages import AUTH_METADATA, PEER_METADATA, parse_hostport, priority_to_pb, status_code
from ..core.congestion import CongestionController
from ..proto import kvflow_pb2 as pb
from ..core.scheduler import Scheduler
from ..transports.tcp import LinkError, WireCall, chunk_frame_prefix, encode_chunk_frame

log = logging.getLogger("ciuicflow.kvflow.sender")

NEW, OPENING, OPEN = "new", "opening", "open"
FATAL_LINK_CODES = {
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
}
PACK_S = 0.02                   # a chunk takes at most this long on the link (see chunk_bytes)
DATA_PLANE_CONNECT_S = 5.0      # a data port that does not answer within this: fall back to gRPC
DATA_PLANE_RETRY_S = 60.0       # ... and try it again after this long (on the next reconnect)


def serialize_frame(frame) -> bytes:
    """Request serializer of the peer stream: PeerFrame messages, or frames already encoded as bytes."""
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


def default_min_cwnd(chunk_size: int) -> int:
    """The sidecar's floor on the window: two chunks, and at least 2 MiB. The BDP is computed from the
    minimum RTT, and a Python sidecar on a busy host sees that minimum in quiet moments only; real round
    trips (scheduling, the peer's event loop) are tens of ms, so a window of a few chunks starves the link
    (measured: 49% of a 100 Mbit/s link with 512 KiB, full with 2 MiB). 2 MiB is ~20 ms at 800 Mbit/s, so
    the queue it can build below us stays short."""
    return max(2 * int(chunk_size), 2 << 20)


class TransferFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass
class OutChunk:
    part: int
    offset: int
    data: bytes
    crc: int
    info: Optional[pb.PartInfo]
    more: tuple = ()            # a packed chunk: the whole parts after the first (see pb.Chunk.more)


class OutTransfer:
    def __init__(self, link: "PeerLink", tid: int, key: str, priority: str, flow: bool,
                 deadline: Optional[float], payload_kind: str, resume: bool, lease_s: float):
        self.link = link
        self.tid = tid
        self.key = key
        self.priority = priority
        self.flow = flow
        self.deadline = deadline                # absolute, time.monotonic()
        self.payload_kind = payload_kind
        self.resume = resume
        self.lease_s = lease_s
        self.uuid = uuidlib.uuid4().hex
        self.chunks: List[OutChunk] = []
        self.closed = False
        self.num_parts = 0
        self.state = NEW
        self.next_seq = 0                       # next chunk to send
        self.acked = 0                          # chunks the receiver holds (contiguous)
        self.released = 0                       # chunks whose bytes were freed (durable receiver only)
        self.remote_crcs: Optional[List[int]] = None
        self.commit_sent = False
        self.opens = 0
        self.stall_logged = False
        self.retries: Dict[int, int] = collections.Counter()
        self.retransmits = 0
        self.resumed = 0
        self.bytes = 0
        self.sent_chunks = 0                    # high-water mark of chunks sent at least once
        self.sent_bytes = 0                     # their bytes
        self.buffered = 0                       # bytes reserved in the memory budget
        self.busy_until = 0.0
        self.last_busy = False
        self.created = time.monotonic()
        self.last_progress = self.created
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.readahead_waiter: Optional[asyncio.Future] = None

    @property
    def unsent_bytes(self) -> int:
        return self.bytes - self.sent_bytes

    @property
    def finished(self) -> bool:
        return self.done.done()

    def outstanding(self) -> bool:
        return self.acked < len(self.chunks) or self.closed

    def head_ready(self, now: float) -> bool:
        return self.state == OPEN and self.next_seq < len(self.chunks) and now >= self.busy_until


class PeerLink:
    def __init__(self, sidecar, name: str, address: str):
        self.sc = sidecar
        cfg = sidecar.cfg
        self.cfg = cfg
        self.name = name
        self.address = address
        self.metrics = sidecar.metrics
        self.sched = Scheduler(time.monotonic, quantum={"normal": cfg.quantum_normal, "low": cfg.quantum_low},
                               max_wait_s=cfg.max_wait_s)
        self.cc = CongestionController(time.monotonic, chunk_bytes=cfg.chunk_size,
                                       min_cwnd_bytes=cfg.min_cwnd or default_min_cwnd(cfg.chunk_size))
        self.transfers: Dict[int, OutTransfer] = {}
        self.by_key: Dict[str, OutTransfer] = {}
        self.fifo: Deque[OutTransfer] = collections.deque()
        self.control: Deque[pb.PeerFrame] = collections.deque()
        self.inflight: Dict[int, tuple] = {}    # sn -> (tid, seq)
        self.connected = False
        self.durable: Optional[bool] = None     # does the peer spool to disk (then acked chunks are freed)
        self.down_since = time.monotonic()
        self.connects = 0
        self.retransmits = 0
        self.sent_chunks = 0
        self._sn = 0
        self._sends = 0
        self._fault_rng = random.Random(12345)
        self._tids = itertools.count(1)
        self._wake = asyncio.Event()
        self._closed = False
        self._flushing = False              # closing: send control frames only, then half-close
        self._flushed = asyncio.Event()     # ... and the receiver has ended the stream
        self._tasks: List[asyncio.Task] = []
        self.channel = sidecar.make_channel(address)
        self._link_method = self.channel.stream_stream(
            "/ciuicflow.kvflow.v1.KVFlowPeer/Link", request_serializer=serialize_frame,
            response_deserializer=pb.PeerReply.FromString)
        self._data_plane_method = self.channel.unary_unary(
            "/ciuicflow.kvflow.v1.KVFlowPeer/DataPlane", request_serializer=pb.DataPlaneRequest.SerializeToString,
            response_deserializer=pb.DataPlaneReply.FromString)
        # The TCP data plane has no TLS: with TLS configured, chunks stay on the gRPC stream.
        self._try_data_plane = cfg.peer_transport == "auto" and not cfg.tls_cert
        self._data_plane_retry_at = 0.0
        self.transport = ""                     # of the current connection: "tcp" or "grpc"
        md = [(PEER_METADATA, cfg.name)]
        if cfg.token:
            md.append((AUTH_METADATA, f"Bearer {cfg.token}"))
        self._metadata = tuple(md)
        self.metrics.link_up.labels(name).set(0)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name=f"link-{self.name}"),
                       asyncio.create_task(self._timers(), name=f"timers-{self.name}")]

    async def close(self, flush_s: float = 0.0) -> None:
        """Stop the link. With ``flush_s``, first deliver the queued control frames (the aborts of a
        shutdown): they sit behind data already in the stream, and cancelling the call would drop them, so
        the stream is half-closed and the receiver's end awaited, for at most ``flush_s`` seconds."""
        if flush_s > 0 and self.connected:
            self._flushing = True
            self.wake()
            try:
                await asyncio.wait_for(self._flushed.wait(), flush_s)
            except asyncio.TimeoutError:
                log.warning("link to %s: the receiver did not confirm the last frames within %gs",
                            self.name, flush_s)
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        await self.channel.close(grace=None)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ the local API feeds transfers
    def create_transfer(self, key: str, priority: str, flow: bool, deadline_s: float, payload_kind: str,
                        resume: bool, lease_s: float) -> OutTransfer:
        if key in self.by_key:
            raise TransferFailed(grpc.StatusCode.ALREADY_EXISTS,
                                 f"a transfer with key {key!r} to {self.name!r} is already in progress")
        deadline = time.monotonic() + deadline_s if deadline_s and deadline_s > 0 else None
        t = OutTransfer(self, next(self._tids), key, priority, flow, deadline, payload_kind, resume, lease_s)
        self.transfers[t.tid] = t
        self.by_key[key] = t
        if flow:
            self.sched.add(t.tid, priority, deadline)
        else:
            self.fifo.append(t)
        self.wake()
        return t

    def add_chunk(self, t: OutTransfer, chunk: OutChunk) -> None:
        if t.acked == len(t.chunks):
            t.last_progress = time.monotonic()
        t.chunks.append(chunk)
        t.bytes += len(chunk.data)
        self._refresh(t)

    def chunk_bytes(self, chunk_size: int, limit: int) -> int:
        """Chunk size on this link: ``chunk_size`` doubled while the link carries the result in PACK_S (so
        a high-priority chunk never waits longer than that behind one), at most ``limit`` (--max-chunk-size,
        4 MiB: the piece a client writes into its default 8 MiB shared-memory window). On a 100 Mbit/s
        link that is ``chunk_size``; on loopback or a fast network, ``limit``: the per-chunk
        work of two sidecars and two clients (a checksum, a frame, an ack, a scheduling decision, the
        handles) then falls 16x for big layers. Doubling keeps chunk boundaries on the client's pieces."""
        bw = self.cc.btl_bw
        size = chunk_size
        while bw > 0 and size * 2 <= min(limit, bw * PACK_S):
            size *= 2
        return size

    async def wait_readahead(self, t: OutTransfer, limit: int) -> None:
        """Ingest back-pressure: hold the local client's stream of a normal/low flow transfer while more
        than ``limit`` of its bytes wait unsent here. Its data then waits in the client (HTTP/2 flow
        control), not in this sidecar's event loop, so a high-priority transfer arriving meanwhile is
        read, checksummed and scheduled at once instead of queueing behind megabytes of bulk ingest."""
        if not t.flow or t.priority == "high" or limit <= 0:
            return
        loop = asyncio.get_running_loop()
        while t.unsent_bytes >= limit and not t.finished and not self._closed:
            t.readahead_waiter = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(t.readahead_waiter), 0.1)
            except asyncio.TimeoutError:
                pass
            finally:
                t.readahead_waiter = None

    def close_transfer(self, t: OutTransfer, num_parts: int) -> None:
        t.closed = True
        t.num_parts = num_parts
        t.last_progress = time.monotonic()
        self._refresh(t)

    # ------------------------------------------------------------------ outcomes
    def fail(self, t: OutTransfer, code: grpc.StatusCode, message: str, notify_peer: bool = True) -> None:
        if t.finished:
            return
        if notify_peer and t.state != NEW and self.connected:
            self.control.append(pb.PeerFrame(abort=pb.Abort(tid=t.tid, code=code.value[0], message=message)))
        log.info("transfer %r to %s failed: %s %s", t.key, self.name, code.name, message)
        t.done.set_exception(TransferFailed(code, message))
        t.done.exception()   # mark retrieved; the local API reads it
        self._finish(t, code.name)

    def _succeed(self, t: OutTransfer) -> None:
        if t.finished:
            return
        elapsed = time.monotonic() - t.created
        t.done.set_result(pb.SendReply(key=t.key, bytes=t.bytes, chunks=len(t.chunks), retransmits=t.retransmits,
                                       resumed_chunks=t.resumed, seconds=elapsed, flow=t.flow))
        self.metrics.latency.labels(t.priority, "send").observe(elapsed)
        self._finish(t, "OK")

    def _finish(self, t: OutTransfer, status: str) -> None:
        self.transfers.pop(t.tid, None)
        if self.by_key.get(t.key) is t:
            del self.by_key[t.key]
        self.sched.remove(t.tid)
        try:
            self.fifo.remove(t)
        except ValueError:
            pass
        t.chunks = []
        self.sc.budget.release(self.name, t.buffered)
        t.buffered = 0
        self.metrics.transfers.labels(self.name, t.priority, "send", status).inc()
        self.wake()

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for t in list(self.transfers.values()):
            self.fail(t, code, message)

    # ------------------------------------------------------------------ scheduling state
    def _refresh(self, t: OutTransfer) -> None:
        if t.finished:
            return
        if t.state == OPEN and t.remote_crcs is not None:
            # Resume: skip the chunks the receiver already holds with the same content.
            if t.next_seq < t.released and len(t.remote_crcs) < t.released:
                self.fail(t, grpc.StatusCode.DATA_LOSS,
                          f"peer {self.name!r} lost chunks it had acknowledged (holds {len(t.remote_crcs)}, "
                          f"{t.released} were freed here); send the transfer again")
                return
            limit = min(len(t.remote_crcs), len(t.chunks))
            while t.next_seq == t.acked and t.next_seq < limit:
                if t.chunks[t.next_seq].crc != t.remote_crcs[t.next_seq]:
                    t.remote_crcs = t.remote_crcs[:t.next_seq]
                    break
                if t.next_seq >= t.sent_chunks:
                    t.sent_chunks = t.next_seq + 1
                    t.sent_bytes += len(t.chunks[t.next_seq].data)
                t.next_seq += 1
                t.acked += 1
                t.resumed += 1
                t.last_progress = time.monotonic()
        if t.flow and t.tid in self.sched:
            now = time.monotonic()
            head = max(len(t.chunks[t.next_seq].data), 1) if t.head_ready(now) else 0
            self.sched.set_ready(t.tid, head)
        self.wake()

    def _has_work(self) -> bool:
        return bool(self.transfers) or bool(self.control)

    # ------------------------------------------------------------------ connection loop
    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            if not self._has_work():
                self._wake.clear()
                if not self._has_work():
                    await self._wake.wait()
                continue
            call, tasks = None, []
            try:
                call = await self._open_stream()
                tasks = [asyncio.create_task(self._read(call)), asyncio.create_task(self._pump(call))]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            except (grpc.aio.AioRpcError, LinkError) as exc:
                self._link_error(exc.code(), exc.details() or "")
            except asyncio.CancelledError:
                raise
            except Exception as exc:    # noqa: BLE001 - any failure of the stream is a lost link
                self._link_error(grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}")
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if call is not None:
                    call.cancel()
                was_connected = self.connected
                self._disconnected()
            if self._flushing:
                self._flushed.set()
                return
            if was_connected:
                backoff = 0.05
            else:
                backoff = min(backoff * 2, 1.0)
            await asyncio.sleep(backoff)

    async def _open_stream(self):
        """The peer's TCP data plane when it offers one (see wire.py), else the gRPC ``Link`` stream."""
        if self._try_data_plane:
            try:
                plane = await self._data_plane_method(pb.DataPlaneRequest(), metadata=self._metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                plane = None        # a peer without a data plane
            if plane is not None and plane.port and time.monotonic() >= self._data_plane_retry_at:
                host, _ = parse_hostport(self.address)
                try:
                    call = await WireCall.connect(host, plane.port, plane.ticket, timeout=DATA_PLANE_CONNECT_S)
                    self.transport = "tcp"
                    return call
                except (OSError, asyncio.TimeoutError) as exc:
                    # The gRPC port answers but the data port does not (a firewall, a port mapping that
                    # left it out): use the gRPC stream, and try the data plane again later.
                    self._data_plane_retry_at = time.monotonic() + DATA_PLANE_RETRY_S
                    log.warning("link to %s: data plane %s:%d unreachable (%s: %s); using the gRPC stream, "
                                "retrying the data plane in %gs", self.name, host, plane.port,
                                type(exc).__name__, exc, DATA_PLANE_RETRY_S)
        self.transport = "grpc"
        return self._link_method(metadata=self._metadata)

    def _link_error(self, code: grpc.StatusCode, details: str) -> None:
        if code in FATAL_LINK_CODES:
            log.warning("link to %s refused: %s %s", self.name, code.name, details)
            self.sc.metrics.rejected.labels(code.name).inc()
            self.fail_all(code, f"peer {self.name!r} refused the link: {details}")
        else:
            log.info("link to %s lost: %s %s", self.name, code.name, details)

    def _disconnected(self) -> None:
        if self.connected:
            self.down_since = time.monotonic()
        self.connected = False
        self.metrics.link_up.labels(self.name).set(0)
        self.cc.reset()
        self.inflight.clear()
        self.control.clear()
        for t in self.transfers.values():
            t.state = NEW
            t.commit_sent = False
            t.remote_crcs = None
            if t.flow and t.tid in self.sched:
                self.sched.set_ready(t.tid, 0)

    # ------------------------------------------------------------------ writing
    async def _pump(self, call) -> None:
        while True:
            if self._flushing:
                while self.control:
                    await call.write(self.control.popleft())
                await call.done_writing()
                await asyncio.Event().wait()    # the reader ends when the receiver closes its side
            self._wake.clear()
            while await self._step(call):
                pass
            timeout = 0.05
            now = time.monotonic()
            if self.sched.has_ready():
                delay = self.cc.send_delay()
                if delay > 0:
                    timeout = min(timeout, delay)
            for t in self.transfers.values():
                if t.busy_until > now:
                    timeout = min(timeout, t.busy_until - now)
                elif t.busy_until:
                    t.busy_until = 0.0
                    self._refresh(t)
            try:
                await asyncio.wait_for(self._wake.wait(), max(timeout, 0.0005))
            except asyncio.TimeoutError:
                pass

    async def _step(self, call) -> bool:
        if self.control:
            await call.write(self.control.popleft())
            return True
        now = time.monotonic()
        for t in self.transfers.values():
            if t.state == NEW:
                t.opens += 1
                # A first, non-resuming open: the receiver starts it empty, so chunks follow the Open
                # at once instead of waiting a round trip for its TransferState.
                t.state = OPEN if t.opens == 1 and not t.resume else OPENING
                if t.state == OPEN:
                    t.remote_crcs = None
                    self._refresh(t)
                remaining = max(t.deadline - now, 1e-3) if t.deadline else 0.0
                await call.write(pb.PeerFrame(open=pb.TransferOpen(
                    tid=t.tid, key=t.key, priority=priority_to_pb(t.priority), deadline_s=remaining,
                    payload_kind=t.payload_kind, uuid=t.uuid, resume=t.resume, lease_s=t.lease_s)))
                return True
            if t.state == OPEN and t.closed and not t.commit_sent and t.next_seq >= len(t.chunks):
                t.commit_sent = True
                await call.write(pb.PeerFrame(commit=pb.Commit(tid=t.tid, total_chunks=len(t.chunks),
                                                               num_parts=t.num_parts)))
                return True
        # FIFO (no flow control): the oldest unfinished transfer goes whole, as fast as gRPC takes it.
        for t in self.fifo:
            if t.state != OPEN:
                break
            if t.head_ready(now):
                await self._send_chunk(call, t)
                return True
            if not t.closed or t.next_seq < len(t.chunks):
                break
        # Flow-controlled transfers: scheduler picks, the congestion controller paces and caps.
        if self.sched.has_ready():
            if self.cc.inflight and self.cc.inflight >= self.cc.cwnd:
                return False
            if self.cc.send_delay() > 0:
                return False
            tid = self.sched.pick()
            t = self.transfers.get(tid)
            if t is None or not t.head_ready(now):
                if t is not None:
                    self._refresh(t)
                return True
            await self._send_chunk(call, t)
            return True
        if self.cc.inflight < self.cc.cwnd:
            self.cc.on_app_limited()
        return False

    async def _send_chunk(self, call, t: OutTransfer) -> None:
        seq = t.next_seq
        chunk = t.chunks[seq]
        t.next_seq += 1
        self._sn += 1
        sn = self._sn
        self._sends += 1
        data = chunk.data
        every = self.cfg.test_corrupt_every
        if every and data and self._fault_rng.random() * every < 1.0:
            data = bytes([data[0] ^ 0xFF]) + data[1:]      # TEST ONLY fault injection: 1 in N at random
        self.inflight[sn] = (t.tid, seq)
        if seq >= t.sent_chunks:
            t.sent_chunks = seq + 1
            t.sent_bytes += len(chunk.data)
            if t.readahead_waiter is not None and not t.readahead_waiter.done():
                t.readahead_waiter.set_result(None)
        self.cc.on_send(sn, len(chunk.data))
        self._refresh(t)
        self.sent_chunks += 1
        self.metrics.bytes.labels(self.name, t.priority, "send").inc(len(chunk.data))
        self.metrics.chunks.labels(self.name, t.priority, "send").inc()
        head = pb.Chunk(tid=t.tid, seq=seq, sn=sn, part=chunk.part, offset=chunk.offset, crc32c=chunk.crc,
                        info=chunk.info, more=chunk.more)
        if isinstance(call, WireCall):
            await call.write_chunk(chunk_frame_prefix(head, len(data)), data)     # no copy of the data here
        else:
            await call.write(encode_chunk_frame(head, data))

    def _release_acked(self, t: OutTransfer) -> None:
        """The peer spools to disk: what it acknowledged survives its restart, so free it here."""
        freed = 0
        while t.released < t.acked:
            chunk = t.chunks[t.released]
            freed += len(chunk.data)
            t.chunks[t.released] = OutChunk(chunk.part, chunk.offset, b"", chunk.crc, None)
            t.released += 1
        if freed:
            t.buffered -= freed
            self.sc.budget.release(self.name, freed)

    # ------------------------------------------------------------------ reading
    async def _read(self, call) -> None:
        async for reply in call:
            kind = reply.WhichOneof("msg")
            if not self.connected:
                self.connected = True
                self.connects += 1
                self.metrics.link_up.labels(self.name).set(1)
                log.info("link to %s (%s) up over %s", self.name, self.address,
                         "the TCP data plane" if self.transport == "tcp" else "gRPC")
            if kind == "ack":
                self._on_ack(reply.ack)
            elif kind == "state":
                self._on_state(reply.state)
            elif kind == "commit":
                t = self.transfers.get(reply.commit.tid)
                if t is None:
                    continue
                if reply.commit.error_code:
                    self.fail(t, status_code(reply.commit.error_code), reply.commit.message, notify_peer=False)
                else:
                    self._succeed(t)

    def _on_state(self, st: pb.TransferState) -> None:
        t = self.transfers.get(st.tid)
        if t is None or t.finished:
            return
        if st.error_code:
            self.fail(t, status_code(st.error_code), st.error, notify_peer=False)
            return
        if st.complete:
            t.resumed = len(t.chunks)
            self._succeed(t)
            return
        self.durable = st.durable
        t.last_progress = time.monotonic()
        if t.state == OPEN and not st.held_chunks:
            return          # optimistic start confirmed
        t.state = OPEN
        t.remote_crcs = list(st.held_crc32c)
        t.next_seq = 0
        t.acked = 0
        self._refresh(t)

    def _on_ack(self, ack: pb.Ack) -> None:
        entry = self.inflight.pop(ack.sn, None)
        sample = self.cc.on_ack(ack.sn)
        if sample is not None:
            self.metrics.rtt_hist.labels(self.name).observe(sample.rtt)
        if entry is None:
            return
        t = self.transfers.get(ack.tid)
        if t is None or t.finished:
            return
        now = time.monotonic()
        code = ack.code
        if code == pb.ACK_OK:
            if ack.seq + 1 > t.acked:
                t.acked = ack.seq + 1
                t.last_progress = now
                t.last_busy = False
            if self.durable:
                self._release_acked(t)
        elif code == pb.ACK_CORRUPT:
            t.retries[ack.seq] += 1
            t.retransmits += 1
            self.retransmits += 1
            self.metrics.retransmits.labels(self.name, "checksum").inc()
            if t.retries[ack.seq] > self.cfg.max_retransmits:
                self.fail(t, grpc.StatusCode.DATA_LOSS,
                          f"chunk {ack.seq} of {t.key!r} failed its checksum {t.retries[ack.seq]} times")
                return
            if t.next_seq > ack.seq:
                t.next_seq = ack.seq
        elif code == pb.ACK_BUSY:
            t.retransmits += 1
            self.retransmits += 1
            self.metrics.retransmits.labels(self.name, "busy").inc()
            t.last_busy = True
            if t.next_seq > ack.seq:
                t.next_seq = ack.seq
            t.busy_until = now + 0.05
        elif code == pb.ACK_FAILED:
            self.fail(t, status_code(ack.error_code), ack.message, notify_peer=False)
            return
        # ACK_OUT_OF_ORDER: an earlier chunk was refused; its own answer already rewound the transfer.
        self._refresh(t)

    # ------------------------------------------------------------------ timers and gauges
    async def _timers(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for t in list(self.transfers.values()):
                if t.deadline is not None and now > t.deadline:
                    self.fail(t, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"transfer {t.key!r} to {self.name!r} missed its deadline "
                              f"({t.acked} of {len(t.chunks)} chunks delivered)")
                elif not self.connected and now - max(self.down_since, t.created) > self.cfg.resume_timeout_s:
                    self.fail(t, grpc.StatusCode.UNAVAILABLE,
                              f"peer {self.name!r} at {self.address} unreachable for {self.cfg.resume_timeout_s:g}s")
                elif t.outstanding() and now - t.last_progress > 5.0 and not t.stall_logged:
                    t.stall_logged = True
                    log.warning("transfer %r: no progress for 5s: state=%s next=%d acked=%d chunks=%d closed=%s commit=%s busy=%s "
                                "connected=%s inflight=%s cwnd=%s delay=%.4f ready=%s flow=%s",
                                t.key, t.state, t.next_seq, t.acked, len(t.chunks), t.closed, t.commit_sent,
                                t.busy_until, self.connected, self.cc.inflight, self.cc.cwnd, self.cc.send_delay(),
                                self.sched.depth(), t.flow)
                if t.finished:
                    continue
                if t.outstanding() and now - t.last_progress > self.cfg.stall_timeout_s:
                    if t.last_busy:
                        self.fail(t, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"peer {self.name!r} refused chunks (memory cap) for {self.cfg.stall_timeout_s:g}s")
                    else:
                        self.fail(t, grpc.StatusCode.UNAVAILABLE,
                                  f"no progress to {self.name!r} for {self.cfg.stall_timeout_s:g}s")
            m = self.metrics
            m.pacing_rate.labels(self.name).set(self.cc.pacing_rate)
            m.btl_bw.labels(self.name).set(self.cc.btl_bw)
            if self.cc.min_rtt != float("inf"):
                m.rtt.labels(self.name).set(self.cc.min_rtt)
            m.cwnd.labels(self.name).set(self.cc.cwnd)
            m.inflight.labels(self.name).set(self.cc.inflight)
            depth = self.sched.depth()
            for t in self.fifo:
                if t.head_ready(now):
                    depth[t.priority] += 1
            for prio, n in depth.items():
                m.queue_depth.labels(self.name, prio).set(n)

    def snapshot(self) -> dict:
        return {
            "address": self.address,
            "connected": self.connected,
            "connects": self.connects,
            "transport": self.transport if self.connected else "",
            "transfers": len(self.transfers),
            "fifo": len(self.fifo),
            "queue": self.sched.depth(),
            "aged_picks": self.sched.stats.aged,
            "sent_chunks": self.sent_chunks,
            "retransmits": self.retransmits,
            "cc": self.cc.snapshot(),
        }
