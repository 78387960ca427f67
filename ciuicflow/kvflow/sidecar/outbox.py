"""The transfers queued for one peer: what the local API created and ingest fills, in the order they go
out (flow transfers: the ``Scheduler``; the others: FIFO), until each one is settled.

Delivery guarantee (docs/kvflow.md, Delivery guarantees): a transfer the receiver committed without a
spool exists only in the receiver's memory, so it is ``retained`` here, bytes and all, after its sender was
told OK, until the receiver says its consumer has it (or its lease expired): the peer sender asks
(``Query``) and, if the receiver lost it (restarted), sends it again (``revive``)."""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import Deque, Dict, List, Optional, Tuple, ValuesView

import grpc

from ..core.scheduler import Scheduler
from ..core.transfer import DONE, OPEN, OutChunk, Transfer, TransferFailed
from ..proto import kvflow_pb2 as pb

log = logging.getLogger("ciuicflow.kvflow.sender")

RETAIN_SLACK_S = 5.0            # a retained transfer is kept this long past its lease at most
QUERY_ITEMS = 256               # retained transfers asked about in one Query
DEFAULT_LEASE_S = 60.0          # a receiver's lease when it did not say (older receivers)


class Outbox:
    """Transfers to peer ``dest``; memory from ``budget``. ``settings``: config.SenderSettings.

    Its only owner is the peer sender (peer_sender.py): the local side reaches it through the sender's
    methods, and the sender tells it of the link (``link_up``, ``link_down``) and of its end (``close``) and
    waits for its changes (``arm``, ``wait_changed``, ``wait_for_work``), for which every change calls
    ``wake``."""

    def __init__(self, dest: str, settings, budget, metrics):
        self.dest = dest
        self._limits = settings.limits
        self._budget = budget
        self._metrics = metrics
        self._sched = Scheduler(time.monotonic, quantum={"normal": settings.quantum_normal,
                                                         "low": settings.quantum_low},
                                max_wait_s=settings.max_wait_s)
        self._transfers: Dict[int, Transfer] = {}
        self._by_key: Dict[str, Transfer] = {}
        self._fifo: Deque[Transfer] = collections.deque()
        self._control: Deque[pb.PeerFrame] = collections.deque()     # frames that go before any chunk
        self._retained: Dict[int, Transfer] = {}     # DONE, kept until the receiver's consumer has them
        self._changed = asyncio.Event()
        self._idle = asyncio.Event()    # no transfer in progress: what a draining shutdown waits for
        self._idle.set()
        self._link_up = False           # an Abort can reach the receiver
        self._closed = False
        self._outcomes: Dict[int, asyncio.Future] = {}
        self._readahead: Dict[int, asyncio.Future] = {}
        self._tids = itertools.count(1)

    # ------------------------------------------------------------------ what the sender is told and asks
    def wake(self) -> None:
        self._changed.set()

    def arm(self) -> None:
        """Forget the changes seen so far: ``wait_changed`` then returns at the next one."""
        self._changed.clear()

    async def wait_changed(self, timeout: float) -> None:
        """Until something changed since ``arm``, or ``timeout`` seconds (the sender's pacing timers)."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def wait_for_work(self) -> None:
        """Until there is something to send or to ask the receiver about (or the outbox closed)."""
        while not self.has_work() and not self._closed:
            self._changed.clear()
            if not self.has_work() and not self._closed:
                await self._changed.wait()

    async def drained(self) -> None:
        """Until no transfer is in progress (retained ones are done: they do not count)."""
        await self._idle.wait()

    def has_work(self) -> bool:
        return bool(self._transfers) or bool(self._control) or bool(self._retained)

    def link_up(self) -> None:
        self._link_up = True

    def link_down(self) -> None:
        """The stream is gone: control frames with it, and every transfer opens again on the next one."""
        self._link_up = False
        self._control.clear()
        for t in self._transfers.values():
            t.disconnected()
            if t.flow and t.tid in self._sched:
                self._sched.set_ready(t.tid, 0)

    def close(self) -> None:
        """The sender stops: ingest waiting for read-ahead room stops waiting."""
        self._closed = True
        for tid in list(self._readahead):
            self._wake_readahead(tid)
        self.wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def next_control(self) -> Optional[pb.PeerFrame]:
        """The next control frame due (they go before any chunk), None when there is none."""
        return self._control.popleft() if self._control else None

    def has_retained(self) -> bool:
        return bool(self._retained)

    def get(self, tid: int) -> Optional[Transfer]:
        return self._transfers.get(tid)

    def in_progress(self) -> ValuesView[Transfer]:
        """The transfers not yet settled, oldest first: a live view, read per frame, so not copied (copy it
        to settle transfers while iterating)."""
        return self._transfers.values()

    def count(self) -> int:
        return len(self._transfers)

    def next_fifo(self, now: float) -> Optional[Transfer]:
        """The FIFO transfer whose chunk goes now: the oldest unfinished one goes whole, as fast as the stream
        takes it, before the next may start (None: none may go now)."""
        for t in self._fifo:
            if t.state != OPEN:
                return None
            if t.head_ready(now):
                return t
            if not t.closed or t.next_seq < len(t.chunks):
                return None
        return None

    def flow_ready(self) -> bool:
        """A flow-controlled transfer has a chunk that may go now."""
        return self._sched.has_ready()

    def pick_flow(self) -> Optional[Transfer]:
        """The flow-controlled transfer the scheduler picks next (None: it is gone)."""
        return self._transfers.get(self._sched.pick())

    def busy_wait(self, now: float, timeout: float) -> float:
        """``timeout``, or less until a transfer the receiver had no memory for may go again; those whose
        back-off ended are made ready again."""
        for t in list(self._transfers.values()):
            if t.busy_until > now:
                timeout = min(timeout, t.busy_until - now)
            elif t.end_busy():
                self.refresh(t)
        return timeout

    def counts(self) -> dict:
        return {"transfers": len(self._transfers), "retained": len(self._retained), "fifo": len(self._fifo),
                "queue": self._sched.depth(), "aged_picks": self._sched.stats.aged}

    def create(self, key: str, priority: str, flow: bool, deadline_s: float, payload_kind: str, resume: bool,
               lease_s: float, uuid: Optional[str] = None) -> Tuple[Transfer, asyncio.Future]:
        """A new transfer, and its outcome: the SendReply once the peer holds it all, or its TransferFailed."""
        if key in self._by_key:
            raise TransferFailed(grpc.StatusCode.ALREADY_EXISTS,
                                 f"a transfer with key {key!r} to {self.dest!r} is already in progress")
        deadline = time.monotonic() + deadline_s if deadline_s and deadline_s > 0 else None
        t = Transfer(next(self._tids), key, self.dest, priority, flow=flow, deadline=deadline,
                     payload_kind=payload_kind, resume=resume, lease_s=lease_s, limits=self._limits, uuid=uuid)
        outcome = self._outcomes[t.tid] = asyncio.get_running_loop().create_future()
        self._enqueue(t)
        return t, outcome

    def _enqueue(self, t: Transfer) -> None:
        self._transfers[t.tid] = t
        self._by_key[t.key] = t
        self._idle.clear()
        if t.flow:
            self._sched.add(t.tid, t.priority, t.deadline)
        else:
            self._fifo.append(t)
        self.wake()

    def add_chunk(self, t: Transfer, chunk: OutChunk) -> None:
        t.add_chunk(chunk)
        self.refresh(t)

    def close_transfer(self, t: Transfer, num_parts: int) -> None:
        t.close(num_parts)
        self.refresh(t)

    async def wait_readahead(self, t: Transfer, limit: int) -> None:
        """Ingest back-pressure: hold the local client's stream of a normal/low flow transfer while more
        than ``limit`` of its bytes wait unsent here. Its data then waits in the client (HTTP/2 flow
        control), not in this sidecar's event loop, so a high-priority transfer arriving meanwhile is
        read, checksummed and scheduled at once instead of queueing behind megabytes of bulk ingest."""
        if not t.flow or t.priority == "high" or limit <= 0:
            return
        loop = asyncio.get_running_loop()
        # Woken by every event of ``t`` (refresh, settle: a chunk sent, chunks the receiver held already)
        # and by close; nothing else lowers its unsent bytes.
        while t.unsent_bytes >= limit and not t.finished and not self._closed:
            waiter = self._readahead[t.tid] = loop.create_future()
            try:
                await waiter
            finally:
                self._readahead.pop(t.tid, None)

    def _wake_readahead(self, tid: int) -> None:
        waiter = self._readahead.get(tid)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def ready_depth(self, now: float) -> Dict[str, int]:
        """Transfers with a chunk that may go now, per class (FIFO ones included)."""
        depth = self._sched.depth()
        for t in self._fifo:
            if t.head_ready(now):
                depth[t.priority] += 1
        return depth

    def fail(self, t: Transfer, code: grpc.StatusCode, message: str) -> None:
        t.fail(code, message)
        self.settle(t)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for t in list(self._transfers.values()):
            self.fail(t, code, message)
        for t in list(self._retained.values()):
            self.release_retained(t)

    # ------------------------------------------------------------------ retained (committed, not durable)
    def release_retained(self, t: Transfer) -> None:
        """The receiver's consumer has ``t`` (or its lease ended, or it was replaced): its bytes go."""
        if self._retained.pop(t.tid, None) is not None:
            self._budget.release(self.dest, t.drop_bytes())
            self.wake()

    def revive(self, t: Transfer) -> None:
        """The receiver lost ``t`` before its consumer had it: send it again (unless a newer transfer of
        the key is under way: then the old one is gone for good)."""
        if self._retained.pop(t.tid, None) is None:
            return
        if t.key in self._by_key:
            self._retained[t.tid] = t
            return self.release_retained(t)
        log.info("transfer %r to %s: the receiver lost it before its consumer had it; sending it again",
                 t.key, self.dest)
        t.revive()
        self._enqueue(t)
        self.refresh(t)

    def query(self, now: float) -> List[pb.QueryItem]:
        """What to ask the receiver about the retained transfers (those past their lease are let go)."""
        items = []
        for t in list(self._retained.values()):
            if t.retain_until is not None and now > t.retain_until:
                self.release_retained(t)
            elif len(items) < QUERY_ITEMS:
                items.append(pb.QueryItem(tid=t.tid, key=t.key, uuid=t.uuid))
        return items

    def on_query(self, reply: pb.QueryReply) -> None:
        for tid, holding in zip(reply.tid, reply.holding):
            t = self._retained.get(tid)
            if t is None or holding == pb.HOLDING_HELD:
                continue
            if holding == pb.HOLDING_UNKNOWN:
                self.revive(t)
            else:
                self.release_retained(t)

    def settle(self, t: Transfer) -> bool:
        """Once ``t`` is DONE or FAILED: resolve its outcome, tell the receiver of a failure, free it."""
        if not t.finished or self._transfers.get(t.tid) is not t:
            return False
        future = self._outcomes.pop(t.tid, None)       # None: told OK already (a revived transfer)
        revived = future is None
        if future is not None and future.done():        # cancelled with the local Send that awaited it
            future = None
        if t.state == DONE:
            reply = t.reply()
            if future is not None:
                future.set_result(reply)
                self._metrics.latency.labels(t.priority, "send").observe(reply.seconds)
            status = "OK"
        else:
            f = t.failure
            if f.tell_peer and self._link_up:
                self._control.append(pb.PeerFrame(abort=pb.Abort(tid=t.tid, code=f.code.value[0], message=f.message)))
            log.log(logging.WARNING if revived else logging.INFO, "transfer %r to %s failed: %s %s%s", t.key,
                    self.dest, f.code.name, f.message,
                    " (sent again after its receiver lost it; its sender had been told OK)" if revived else "")
            if future is not None:
                future.set_exception(f)
                future.exception()   # mark retrieved; the local API reads it
            status = f.code.name
        del self._transfers[t.tid]
        if self._by_key.get(t.key) is t:
            del self._by_key[t.key]
        if not self._transfers:
            self._idle.set()
        self._sched.remove(t.tid)
        try:
            self._fifo.remove(t)
        except ValueError:
            pass
        if not revived:
            self._metrics.transfers.labels(self.dest, t.priority, "send", status).inc()
        if t.state == DONE and not t.durable and t.queryable:
            # only in the receiver's memory: kept (bytes and budget) until its consumer has it
            t.retain(time.monotonic() + (t.lease_s or DEFAULT_LEASE_S) + RETAIN_SLACK_S)
            self._retained[t.tid] = t
        else:
            self._budget.release(self.dest, t.drop_bytes())
        self._wake_readahead(t.tid)
        self.wake()
        return True

    def refresh(self, t: Transfer) -> None:
        """After an event of ``t``: settle it if it ended, else tell the scheduler what it has ready."""
        if self.settle(t) or t.finished:
            return
        if t.flow and t.tid in self._sched:
            self._sched.set_ready(t.tid, t.head_bytes(time.monotonic()))
        if self._readahead:
            self._wake_readahead(t.tid)
        self.wake()
