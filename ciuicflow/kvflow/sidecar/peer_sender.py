"""Sending side of a sidecar: one ``PeerSender`` per destination peer.

A sender keeps one stream to its peer open (over the first of its ``transports`` the peer offers) and writes
what its ``Outbox`` has due: control frames, opens and commits, then chunks, FIFO for transfers sent
without ``x-ciuic-flow: enabled`` (as fast as the stream takes them: the baseline), else in the order of
the outbox's scheduler, paced and capped by a ``CongestionController`` fed by the acknowledgements. Each
transfer's protocol state is a ``core.transfer.Transfer``.

The sender owns the link (stream, congestion control, what the peer said of itself) and its outbox; the
local side (local API, ingest, peers, app) asks it through the methods under "the local side", never
reaching into the outbox.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Dict, List, Optional, Sequence

import grpc

from ..core.chunking import chunk_bytes
from ..core.congestion import CongestionController
from ..core.transfer import NEW, OutChunk, Transfer
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
        self._budget = budget
        self._metrics = metrics
        self._transports = list(transports)
        self._outbox = Outbox(name, settings, budget, metrics)
        self._cc = CongestionController(time.monotonic, chunk_bytes=settings.chunk_size,
                                        min_cwnd_bytes=settings.min_cwnd, min_cwnd_s=settings.min_cwnd_s)
        self._inflight: Dict[int, tuple] = {}    # sn -> (tid, seq)
        self._connected = False
        self._durable: Optional[bool] = None     # does the peer spool to disk (then acked chunks are freed)
        self._durable_known = asyncio.Event()    # ... learnt (its first TransferState): ingest waits for it
        self._down_since = time.monotonic()
        self._connects = 0
        self._retransmits = 0
        self._sent_chunks = 0
        self._kind = ""                          # the current stream's transport: "tcp" or "grpc"
        self._closed = False
        self._sn = 0
        self._next_query = 0.0
        self._flushing = False              # closing: send control frames only, then half-close
        self._flushed = asyncio.Event()     # ... and the receiver has ended the stream
        self._tasks: List[asyncio.Task] = []
        self._metrics.link_up.labels(name).set(0)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run(), name=f"sender-{self.name}"),
                       asyncio.create_task(self._timers(), name=f"timers-{self.name}")]

    async def close(self, flush_s: float = 0.0) -> None:
        """Stop. With ``flush_s``, first deliver the queued control frames (the aborts of a shutdown): they
        sit behind data already in the stream, and dropping the stream would lose them, so it is
        half-closed and the receiver's end awaited, for at most ``flush_s`` seconds."""
        if flush_s > 0 and self._connected:
            self._flushing = True
            self._outbox.wake()
            try:
                await asyncio.wait_for(self._flushed.wait(), flush_s)
            except asyncio.TimeoutError:
                log.warning("link to %s: the receiver did not confirm the last frames within %gs",
                            self.name, flush_s)
        self._closed = True
        self._outbox.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    # ------------------------------------------------------------------ the local side
    def create(self, key: str, priority: str, flow: bool, deadline_s: float, payload_kind: str, resume: bool,
               lease_s: float, uuid: Optional[str] = None):
        """A new transfer to this peer and its outcome future (Outbox.create)."""
        return self._outbox.create(key, priority, flow, deadline_s, payload_kind, resume, lease_s, uuid)

    def add_chunk(self, t: Transfer, chunk: OutChunk) -> None:
        self._outbox.add_chunk(t, chunk)

    def close_transfer(self, t: Transfer, num_parts: int) -> None:
        self._outbox.close_transfer(t, num_parts)

    async def wait_readahead(self, t: Transfer, limit: int) -> None:
        await self._outbox.wait_readahead(t, limit)

    def fail(self, t: Transfer, code: grpc.StatusCode, message: str) -> None:
        self._outbox.fail(t, code, message)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        self._outbox.fail_all(code, message)

    def in_progress(self) -> int:
        """Transfers to this peer not yet settled."""
        return self._outbox.count()

    async def drained(self) -> None:
        """Until no transfer to this peer is in progress."""
        await self._outbox.drained()

    def link_bandwidth(self) -> float:
        """The link's bandwidth estimate in bytes/s (0 while it is down)."""
        return self._cc.btl_bw if self._connected else 0.0

    def chunk_bytes(self, chunk_size: int, limit: int) -> int:
        """Chunk size to this peer now, from its measured bandwidth (core.chunking.chunk_bytes)."""
        return chunk_bytes(self._cc.btl_bw, chunk_size, limit)

    async def peer_durable(self, timeout: float) -> Optional[bool]:
        """Whether the peer spools to disk, waiting up to ``timeout`` seconds to learn it from its first
        TransferState (None: not learnt)."""
        if self._durable is None:
            try:
                await asyncio.wait_for(self._durable_known.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self._durable

    # ------------------------------------------------------------------ connection loop
    async def _run(self) -> None:
        box = self._outbox
        backoff = 0.05
        while not self._closed:
            if not box.has_work():
                await box.wait_for_work()
                continue
            stream, tasks = None, []
            try:
                stream = await open_first(self._transports)
                self._kind = stream.kind
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
                was_connected = self._connected
                self._disconnected()
            if self._flushing:
                self._flushed.set()
                return
            backoff = 0.05 if was_connected else min(backoff * 2, 1.0)
            await asyncio.sleep(backoff)

    def _stream_error(self, code: grpc.StatusCode, details: str) -> None:
        if code in FATAL_CODES:
            log.warning("link to %s refused: %s %s", self.name, code.name, details)
            self._metrics.rejected.labels(code.name).inc()
            self._outbox.fail_all(code, f"peer {self.name!r} refused the link: {details}")
        else:
            log.info("link to %s lost: %s %s", self.name, code.name, details)

    def _disconnected(self) -> None:
        if self._connected:
            self._down_since = time.monotonic()
        self._connected = False
        self._metrics.link_up.labels(self.name).set(0)
        self._cc.reset()
        self._inflight.clear()
        self._outbox.link_down()

    # ------------------------------------------------------------------ writing
    async def _pump(self, stream: Stream) -> None:
        box = self._outbox
        while True:
            if self._flushing:
                frame = box.next_control()
                while frame is not None:
                    await stream.send(frame)
                    frame = box.next_control()
                await stream.finish_sending()
                await asyncio.Event().wait()    # the reader ends when the receiver closes its side
            box.arm()
            while await self._step(stream):
                pass
            # Woken by the outbox's next change, or by the first timer due: pacing, the next Query, a
            # receiver's back-off ending.
            timeout = 0.05
            now = time.monotonic()
            if box.flow_ready():
                delay = self._cc.send_delay()
                if delay > 0:
                    timeout = min(timeout, delay)
            if box.has_retained():
                timeout = min(timeout, max(self._next_query - now, 0.0))
            timeout = box.busy_wait(now, timeout)
            await box.wait_changed(max(timeout, 0.0005))

    async def _step(self, stream: Stream) -> bool:
        """Write the next frame that is due; False when nothing may go now."""
        box = self._outbox
        frame = box.next_control()
        if frame is not None:
            await stream.send(frame)
            return True
        now = time.monotonic()
        if box.has_retained() and now >= self._next_query:
            self._next_query = now + QUERY_S
            items = box.query(now)
            if items:
                await stream.send(pb.PeerFrame(query=pb.Query(items=items)))
                return True
        for t in box.in_progress():
            if t.state == NEW:
                frame = pb.PeerFrame(open=t.open())
                box.refresh(t)
                await stream.send(frame)
                return True
            if t.commit_due():
                await stream.send(pb.PeerFrame(commit=t.commit()))
                return True
        # FIFO (no flow control): the oldest unfinished transfer goes whole, as fast as the stream takes it.
        t = box.next_fifo(now)
        if t is not None:
            await self._send_chunk(stream, t)
            return True
        # Flow-controlled transfers: scheduler picks, the congestion controller paces and caps.
        cc = self._cc
        if box.flow_ready():
            if cc.inflight and cc.inflight >= cc.cwnd:
                return False
            if cc.send_delay() > 0:
                return False
            t = box.pick_flow()
            if t is None or not t.head_ready(now):
                if t is not None:
                    box.refresh(t)
                return True
            await self._send_chunk(stream, t)
            return True
        if cc.inflight < cc.cwnd:
            cc.on_app_limited()
        return False

    async def _send_chunk(self, stream: Stream, t: Transfer) -> None:
        seq, chunk, _ = t.take_chunk()
        self._sn += 1
        sn = self._sn
        self._inflight[sn] = (t.tid, seq)
        self._cc.on_send(sn, len(chunk.data))
        self._outbox.refresh(t)         # also lets its ingest read further (Outbox.wait_readahead)
        self._sent_chunks += 1
        self._metrics.bytes.labels(self.name, t.priority, "send").inc(len(chunk.data))
        self._metrics.chunks.labels(self.name, t.priority, "send").inc()
        await stream.send_chunk(pb.Chunk(tid=t.tid, seq=seq, sn=sn, part=chunk.part, offset=chunk.offset,
                                         crc32c=chunk.crc, info=chunk.info, more=chunk.more), chunk.data)

    # ------------------------------------------------------------------ reading
    async def _read(self, stream: Stream) -> None:
        async for reply in stream.replies():
            if not self._connected:
                self._connected = True
                self._outbox.link_up()
                self._connects += 1
                self._metrics.link_up.labels(self.name).set(1)
                log.info("link to %s (%s) up over %s", self.name, self.address,
                         "the TCP data plane" if self._kind == "tcp" else "gRPC")
            kind = reply.WhichOneof("msg")
            if kind == "ack":
                self._on_ack(reply.ack)
            elif kind == "state":
                st = reply.state
                t = self._outbox.get(st.tid)
                if t is not None:
                    if not st.error_code and not st.complete:
                        self._durable = st.durable
                        self._durable_known.set()
                    t.on_state(st)
                    self._outbox.refresh(t)
            elif kind == "commit":
                t = self._outbox.get(reply.commit.tid)
                if t is not None:
                    t.on_commit(reply.commit)
                    self._outbox.settle(t)
            elif kind == "query":
                self._outbox.on_query(reply.query)

    def _on_ack(self, ack: pb.Ack) -> None:
        entry = self._inflight.pop(ack.sn, None)
        sample = self._cc.on_ack(ack.sn)
        if sample is not None:
            self._metrics.rtt_hist.labels(self.name).observe(sample.rtt)
        if entry is None:
            return
        t = self._outbox.get(ack.tid)
        if t is None or t.finished:
            return
        reason = {pb.ACK_CORRUPT: "checksum", pb.ACK_BUSY: "busy"}.get(ack.code)
        if reason is not None:
            self._retransmits += 1
            self._metrics.retransmits.labels(self.name, reason).inc()
        freed = t.on_ack(ack, durable=bool(self._durable))
        if freed:
            self._budget.release(self.name, freed)
        self._outbox.refresh(t)

    # ------------------------------------------------------------------ timers and gauges
    async def _timers(self) -> None:
        while True:
            await asyncio.sleep(TIMER_S)
            now = time.monotonic()
            down_since = None if self._connected else self._down_since
            for t in list(self._outbox.in_progress()):
                t.check_time(now, down_since, self.address)
                if self._outbox.settle(t):
                    continue
                if t.stalled(now, STALL_LOG_S):
                    log.warning("transfer %r: no progress for %gs: state=%s next=%d acked=%d chunks=%d closed=%s "
                                "commit=%s busy=%s connected=%s inflight=%s cwnd=%s delay=%.4f ready=%s flow=%s",
                                t.key, STALL_LOG_S, t.state, t.next_seq, t.acked, len(t.chunks), t.closed,
                                t.commit_sent, t.busy_until, self._connected, self._cc.inflight, self._cc.cwnd,
                                self._cc.send_delay(), self._outbox.counts()["queue"], t.flow)
            self._metrics.sender_state(self.name, self._cc, self._outbox.ready_depth(now))

    def snapshot(self) -> dict:
        counts = self._outbox.counts()
        return {
            "address": self.address,
            "connected": self._connected,
            "connects": self._connects,
            "transport": self._kind if self._connected else "",
            "transfers": counts["transfers"],
            "retained": counts["retained"],
            "fifo": counts["fifo"],
            "queue": counts["queue"],
            "aged_picks": counts["aged_picks"],
            "sent_chunks": self._sent_chunks,
            "retransmits": self._retransmits,
            "cc": self._cc.snapshot(),
        }
