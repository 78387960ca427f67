"""Sending side of a sidecar: one ``PeerSender`` per destination peer.

A sender keeps one stream to its peer open (over the first of its ``transports`` the peer offers) and writes
what its ``Outbox`` has due: control frames, opens and commits, then chunks, FIFO for transfers sent
without ``x-ciuic-flow: enabled`` (as fast as the stream takes them: the baseline), else in the order of
the outbox's scheduler, paced and capped by a ``CongestionController`` fed by the acknowledgements. Each
transfer's protocol state is a ``core.transfer.Transfer``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, List, Optional, Sequence

import grpc

from ..core.chunking import chunk_bytes
from ..core.congestion import CongestionController
from ..core.transfer import NEW, OPEN, Transfer
from ..proto import kvflow_pb2 as pb
from ..transports.base import Stream, Transport, TransportError, open_first
from .outbox import Outbox

log = logging.getLogger("ciuicflow.kvflow.sender")

# A refusal by the peer rather than a lost connection: retrying would only be refused again.
FATAL_CODES = {
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
}
STALL_LOG_S = 5.0               # a transfer without progress this long is logged (once) with the sender's state
TIMER_S = 0.1                   # how often deadlines, timeouts and gauges are checked
QUERY_S = 0.2                   # how often the receiver is asked about retained transfers (outbox.py)


class PeerSender:
    """Transfers to peer ``name`` at ``address`` (``outbox``), over the first of ``transports`` the peer
    offers (the last is always tried); memory from ``budget``. ``settings``: config.SenderSettings."""

    def __init__(self, name: str, address: str, settings, budget, metrics, transports: Sequence[Transport]):
        self.name = name
        self.address = address
        self.budget = budget
        self.metrics = metrics
        self.transports = list(transports)
        self.outbox = Outbox(name, settings, budget, metrics)
        self.cc = CongestionController(time.monotonic, chunk_bytes=settings.chunk_size,
                                       min_cwnd_bytes=settings.min_cwnd, min_cwnd_s=settings.min_cwnd_s)
        self.inflight: Dict[int, tuple] = {}    # sn -> (tid, seq)
        self.connected = False
        self.durable: Optional[bool] = None     # does the peer spool to disk (then acked chunks are freed)
        self.down_since = time.monotonic()
        self.connects = 0
        self.retransmits = 0
        self.sent_chunks = 0
        self.kind = ""                          # the current stream's transport: "tcp" or "grpc"
        self._sn = 0
        self._next_query = 0.0
        self._flushing = False              # closing: send control frames only, then half-close
        self._flushed = asyncio.Event()     # ... and the receiver has ended the stream
        self._tasks: List[asyncio.Task] = []
        self.metrics.link_up.labels(name).set(0)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name=f"sender-{self.name}"),
                       asyncio.create_task(self._timers(), name=f"timers-{self.name}")]

    async def close(self, flush_s: float = 0.0) -> None:
        """Stop. With ``flush_s``, first deliver the queued control frames (the aborts of a shutdown): they
        sit behind data already in the stream, and dropping the stream would lose them, so it is
        half-closed and the receiver's end awaited, for at most ``flush_s`` seconds."""
        if flush_s > 0 and self.connected:
            self._flushing = True
            self.outbox.wake()
            try:
                await asyncio.wait_for(self._flushed.wait(), flush_s)
            except asyncio.TimeoutError:
                log.warning("link to %s: the receiver did not confirm the last frames within %gs",
                            self.name, flush_s)
        self.outbox.closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    def chunk_bytes(self, chunk_size: int, limit: int) -> int:
        """Chunk size to this peer now, from its measured bandwidth (core.chunking.chunk_bytes)."""
        return chunk_bytes(self.cc.btl_bw, chunk_size, limit)

    # ------------------------------------------------------------------ connection loop
    async def _run(self) -> None:
        box = self.outbox
        backoff = 0.05
        while not box.closed:
            if not box.has_work():
                box.changed.clear()
                if not box.has_work():
                    await box.changed.wait()
                continue
            stream, tasks = None, []
            try:
                stream = await open_first(self.transports)
                self.kind = stream.kind
                tasks = [asyncio.create_task(self._read(stream)), asyncio.create_task(self._pump(stream))]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()
            except TransportError as exc:
                self._stream_error(exc.code, exc.details)
            except asyncio.CancelledError:
                raise
            except Exception as exc:    # noqa: BLE001 - any failure of the stream is a lost connection
                self._stream_error(grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}")
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if stream is not None:
                    stream.abort()
                was_connected = self.connected
                self._disconnected()
            if self._flushing:
                self._flushed.set()
                return
            backoff = 0.05 if was_connected else min(backoff * 2, 1.0)
            await asyncio.sleep(backoff)

    def _stream_error(self, code: grpc.StatusCode, details: str) -> None:
        if code in FATAL_CODES:
            log.warning("link to %s refused: %s %s", self.name, code.name, details)
            self.metrics.rejected.labels(code.name).inc()
            self.outbox.fail_all(code, f"peer {self.name!r} refused the link: {details}")
        else:
            log.info("link to %s lost: %s %s", self.name, code.name, details)

    def _disconnected(self) -> None:
        if self.connected:
            self.down_since = time.monotonic()
        self.connected = False
        self.metrics.link_up.labels(self.name).set(0)
        self.cc.reset()
        self.inflight.clear()
        self.outbox.disconnected()

    # ------------------------------------------------------------------ writing
    async def _pump(self, stream: Stream) -> None:
        box = self.outbox
        while True:
            if self._flushing:
                while box.control:
                    await stream.send(box.control.popleft())
                await stream.finish_sending()
                await asyncio.Event().wait()    # the reader ends when the receiver closes its side
            box.changed.clear()
            while await self._step(stream):
                pass
            timeout = 0.05
            now = time.monotonic()
            if box.sched.has_ready():
                delay = self.cc.send_delay()
                if delay > 0:
                    timeout = min(timeout, delay)
            if box.retained:
                timeout = min(timeout, max(self._next_query - now, 0.0))
            for t in list(box.transfers.values()):
                if t.busy_until > now:
                    timeout = min(timeout, t.busy_until - now)
                elif t.busy_until:
                    t.busy_until = 0.0
                    box.refresh(t)
            try:
                await asyncio.wait_for(box.changed.wait(), max(timeout, 0.0005))
            except asyncio.TimeoutError:
                pass

    async def _step(self, stream: Stream) -> bool:
        """Write the next frame that is due; False when nothing may go now."""
        box = self.outbox
        if box.control:
            await stream.send(box.control.popleft())
            return True
        now = time.monotonic()
        if box.retained and now >= self._next_query:
            self._next_query = now + QUERY_S
            items = box.query(now)
            if items:
                await stream.send(pb.PeerFrame(query=pb.Query(items=items)))
                return True
        for t in box.transfers.values():
            if t.state == NEW:
                frame = pb.PeerFrame(open=t.open())
                box.refresh(t)
                await stream.send(frame)
                return True
            if t.commit_due():
                await stream.send(pb.PeerFrame(commit=t.commit()))
                return True
        # FIFO (no flow control): the oldest unfinished transfer goes whole, as fast as the stream takes it.
        for t in box.fifo:
            if t.state != OPEN:
                break
            if t.head_ready(now):
                await self._send_chunk(stream, t)
                return True
            if not t.closed or t.next_seq < len(t.chunks):
                break
        # Flow-controlled transfers: scheduler picks, the congestion controller paces and caps.
        if box.sched.has_ready():
            if self.cc.inflight and self.cc.inflight >= self.cc.cwnd:
                return False
            if self.cc.send_delay() > 0:
                return False
            t = box.transfers.get(box.sched.pick())
            if t is None or not t.head_ready(now):
                if t is not None:
                    box.refresh(t)
                return True
            await self._send_chunk(stream, t)
            return True
        if self.cc.inflight < self.cc.cwnd:
            self.cc.on_app_limited()
        return False

    async def _send_chunk(self, stream: Stream, t: Transfer) -> None:
        seq, chunk, first = t.take_chunk()
        self._sn += 1
        sn = self._sn
        self.inflight[sn] = (t.tid, seq)
        if first:
            self.outbox.sent_first(t)
        self.cc.on_send(sn, len(chunk.data))
        self.outbox.refresh(t)
        self.sent_chunks += 1
        self.metrics.bytes.labels(self.name, t.priority, "send").inc(len(chunk.data))
        self.metrics.chunks.labels(self.name, t.priority, "send").inc()
        await stream.send_chunk(pb.Chunk(tid=t.tid, seq=seq, sn=sn, part=chunk.part, offset=chunk.offset,
                                         crc32c=chunk.crc, info=chunk.info, more=chunk.more), chunk.data)

    # ------------------------------------------------------------------ reading
    async def _read(self, stream: Stream) -> None:
        async for reply in stream.replies():
            if not self.connected:
                self.connected = self.outbox.connected = True
                self.connects += 1
                self.metrics.link_up.labels(self.name).set(1)
                log.info("link to %s (%s) up over %s", self.name, self.address,
                         "the TCP data plane" if self.kind == "tcp" else "gRPC")
            kind = reply.WhichOneof("msg")
            if kind == "ack":
                self._on_ack(reply.ack)
            elif kind == "state":
                st = reply.state
                t = self.outbox.transfers.get(st.tid)
                if t is not None:
                    if not st.error_code and not st.complete:
                        self.durable = st.durable
                    t.on_state(st)
                    self.outbox.refresh(t)
            elif kind == "commit":
                t = self.outbox.transfers.get(reply.commit.tid)
                if t is not None:
                    t.on_commit(reply.commit)
                    self.outbox.settle(t)
            elif kind == "query":
                self.outbox.on_query(reply.query)

    def _on_ack(self, ack: pb.Ack) -> None:
        entry = self.inflight.pop(ack.sn, None)
        sample = self.cc.on_ack(ack.sn)
        if sample is not None:
            self.metrics.rtt_hist.labels(self.name).observe(sample.rtt)
        if entry is None:
            return
        t = self.outbox.transfers.get(ack.tid)
        if t is None or t.finished:
            return
        reason = {pb.ACK_CORRUPT: "checksum", pb.ACK_BUSY: "busy"}.get(ack.code)
        if reason is not None:
            self.retransmits += 1
            self.metrics.retransmits.labels(self.name, reason).inc()
        freed = t.on_ack(ack, durable=bool(self.durable))
        if freed:
            self.budget.release(self.name, freed)
        self.outbox.refresh(t)

    # ------------------------------------------------------------------ timers and gauges
    async def _timers(self) -> None:
        while True:
            await asyncio.sleep(TIMER_S)
            now = time.monotonic()
            down_since = None if self.connected else self.down_since
            for t in list(self.outbox.transfers.values()):
                t.check_time(now, down_since, self.address)
                if self.outbox.settle(t):
                    continue
                if t.outstanding() and now - t.last_progress > STALL_LOG_S and not t.stall_logged:
                    t.stall_logged = True
                    log.warning("transfer %r: no progress for %gs: state=%s next=%d acked=%d chunks=%d closed=%s "
                                "commit=%s busy=%s connected=%s inflight=%s cwnd=%s delay=%.4f ready=%s flow=%s",
                                t.key, STALL_LOG_S, t.state, t.next_seq, t.acked, len(t.chunks), t.closed,
                                t.commit_sent, t.busy_until, self.connected, self.cc.inflight, self.cc.cwnd,
                                self.cc.send_delay(), self.outbox.sched.depth(), t.flow)
            self.metrics.sender_state(self.name, self.cc, self.outbox.ready_depth(now))

    def snapshot(self) -> dict:
        return {
            "address": self.address,
            "connected": self.connected,
            "connects": self.connects,
            "transport": self.kind if self.connected else "",
            "transfers": len(self.outbox.transfers),
            "retained": len(self.outbox.retained),
            "fifo": len(self.outbox.fifo),
            "queue": self.outbox.sched.depth(),
            "aged_picks": self.outbox.sched.stats.aged,
            "sent_chunks": self.sent_chunks,
            "retransmits": self.retransmits,
            "cc": self.cc.snapshot(),
        }
