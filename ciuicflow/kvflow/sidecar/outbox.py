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
from typing import Deque, Dict, List, Optional, Tuple

import grpc

from ..core.scheduler import Scheduler
from ..core.transfer import DONE, OutChunk, Transfer, TransferFailed
from ..proto import kvflow_pb2 as pb

log = logging.getLogger("ciuicflow.kvflow.sender")

RETAIN_SLACK_S = 5.0            # a retained transfer is kept this long past its lease at most
QUERY_ITEMS = 256               # retained transfers asked about in one Query


class Outbox:
    """Transfers to peer ``dest``; memory from ``budget``. ``settings``: config.SenderSettings. The peer
    sender sets ``connected`` (an Abort can reach the receiver) and ``closed``, and waits on ``changed``."""

    def __init__(self, dest: str, settings, budget, metrics):
        self.dest = dest
        self.limits = settings.limits
        self.budget = budget
        self.metrics = metrics
        self.sched = Scheduler(time.monotonic, quantum={"normal": settings.quantum_normal, "low": settings.quantum_low},
                               max_wait_s=settings.max_wait_s)
        self.transfers: Dict[int, Transfer] = {}
        self.by_key: Dict[str, Transfer] = {}
        self.fifo: Deque[Transfer] = collections.deque()
        self.control: Deque[pb.PeerFrame] = collections.deque()     # frames that go before any chunk
        self.retained: Dict[int, Transfer] = {}     # DONE, kept until the receiver's consumer has them
        self.changed = asyncio.Event()
        self.connected = False
        self.closed = False
        self._outcomes: Dict[int, asyncio.Future] = {}
        self._readahead: Dict[int, asyncio.Future] = {}
        self._tids = itertools.count(1)
        self.default_lease_s = 60.0     # a receiver's lease when it did not say (older receivers)

    def wake(self) -> None:
        self.changed.set()

    def has_work(self) -> bool:
        return bool(self.transfers) or bool(self.control) or bool(self.retained)

    def create(self, key: str, priority: str, flow: bool, deadline_s: float, payload_kind: str, resume: bool,
               lease_s: float, uuid: Optional[str] = None) -> Tuple[Transfer, asyncio.Future]:
        """A new transfer, and its outcome: the SendReply once the peer holds it all, or its TransferFailed."""
        if key in self.by_key:
            raise TransferFailed(grpc.StatusCode.ALREADY_EXISTS,
                                 f"a transfer with key {key!r} to {self.dest!r} is already in progress")
        deadline = time.monotonic() + deadline_s if deadline_s and deadline_s > 0 else None
        t = Transfer(next(self._tids), key, self.dest, priority, flow=flow, deadline=deadline,
                     payload_kind=payload_kind, resume=resume, lease_s=lease_s, limits=self.limits, uuid=uuid)
        self.transfers[t.tid] = t
        self.by_key[key] = t
        outcome = self._outcomes[t.tid] = asyncio.get_running_loop().create_future()
        if flow:
            self.sched.add(t.tid, priority, deadline)
        else:
            self.fifo.append(t)
        self.wake()
        return t, outcome

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
        while t.unsent_bytes >= limit and not t.finished and not self.closed:
            waiter = self._readahead[t.tid] = loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(waiter), 0.1)
            except asyncio.TimeoutError:
                pass
            finally:
                self._readahead.pop(t.tid, None)

    def sent_first(self, t: Transfer) -> None:
        """A chunk of ``t`` went out for the first time: its ingest may read further."""
        waiter = self._readahead.get(t.tid)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def disconnected(self) -> None:
        self.connected = False
        self.control.clear()
        for t in self.transfers.values():
            t.disconnected()
            if t.flow and t.tid in self.sched:
                self.sched.set_ready(t.tid, 0)

    def ready_depth(self, now: float) -> Dict[str, int]:
        """Transfers with a chunk that may go now, per class (FIFO ones included)."""
        depth = self.sched.depth()
        for t in self.fifo:
            if t.head_ready(now):
                depth[t.priority] += 1
        return depth

    def fail(self, t: Transfer, code: grpc.StatusCode, message: str) -> None:
        t.fail(code, message)
        self.settle(t)

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for t in list(self.transfers.values()):
            self.fail(t, code, message)
        for t in list(self.retained.values()):
            self.release_retained(t)

    # ------------------------------------------------------------------ retained (committed, not durable)
    def release_retained(self, t: Transfer) -> None:
        """The receiver's consumer has ``t`` (or its lease ended, or it was replaced): its bytes go."""
        if self.retained.pop(t.tid, None) is not None:
            self.budget.release(self.dest, t.buffered)
            t.buffered = 0
            t.chunks = []
            self.wake()

    def revive(self, t: Transfer) -> None:
        """The receiver lost ``t`` before its consumer had it: send it again (unless a newer transfer of
        the key is under way: then the old one is gone for good)."""
        if self.retained.pop(t.tid, None) is None:
            return
        if t.key in self.by_key:
            self.retained[t.tid] = t
            return self.release_retained(t)
        log.info("transfer %r to %s: the receiver lost it before its consumer had it; sending it again",
                 t.key, self.dest)
        t.revive()
        self.transfers[t.tid] = t
        self.by_key[t.key] = t
        if t.flow:
            self.sched.add(t.tid, t.priority, t.deadline)
        else:
            self.fifo.append(t)
        self.refresh(t)

    def query(self, now: float) -> List[pb.QueryItem]:
        """What to ask the receiver about the retained transfers (those past their lease are let go)."""
        items = []
        for t in list(self.retained.values()):
            if t.retain_until is not None and now > t.retain_until:
                self.release_retained(t)
            elif len(items) < QUERY_ITEMS:
                items.append(pb.QueryItem(tid=t.tid, key=t.key, uuid=t.uuid))
        return items

    def on_query(self, reply: pb.QueryReply) -> None:
        for tid, holding in zip(reply.tid, reply.holding):
            t = self.retained.get(tid)
            if t is None or holding == pb.HOLDING_HELD:
                continue
            if holding == pb.HOLDING_UNKNOWN:
                self.revive(t)
            else:
                self.release_retained(t)

    def settle(self, t: Transfer) -> bool:
        """Once ``t`` is DONE or FAILED: resolve its outcome, tell the receiver of a failure, free it."""
        if not t.finished or self.transfers.get(t.tid) is not t:
            return False
        future = self._outcomes.pop(t.tid, None)       # None: told OK already (a revived transfer)
        revived = future is None
        if future is not None and future.done():        # cancelled with the local Send that awaited it
            future = None
        if t.state == DONE:
            reply = t.reply()
            if future is not None:
                future.set_result(reply)
                self.metrics.latency.labels(t.priority, "send").observe(reply.seconds)
            status = "OK"
        else:
            f = t.failure
            if f.tell_peer and self.connected:
                self.control.append(pb.PeerFrame(abort=pb.Abort(tid=t.tid, code=f.code.value[0], message=f.message)))
            log.log(logging.WARNING if revived else logging.INFO, "transfer %r to %s failed: %s %s%s", t.key,
                    self.dest, f.code.name, f.message,
                    " (sent again after its receiver lost it; its sender had been told OK)" if revived else "")
            if future is not None:
                future.set_exception(f)
                future.exception()   # mark retrieved; the local API reads it
            status = f.code.name
        del self.transfers[t.tid]
        if self.by_key.get(t.key) is t:
            del self.by_key[t.key]
        self.sched.remove(t.tid)
        try:
            self.fifo.remove(t)
        except ValueError:
            pass
        if not revived:
            self.metrics.transfers.labels(self.dest, t.priority, "send", status).inc()
        if t.state == DONE and not t.durable and t.queryable:
            # only in the receiver's memory: kept (bytes and budget) until its consumer has it
            t.retain_until = time.monotonic() + (t.lease_s or self.default_lease_s) + RETAIN_SLACK_S
            self.retained[t.tid] = t
        else:
            t.chunks = []
            self.budget.release(self.dest, t.buffered)
            t.buffered = 0
        self.wake()
        return True

    def refresh(self, t: Transfer) -> None:
        """After an event of ``t``: settle it if it ended, else tell the scheduler what it has ready."""
        if self.settle(t) or t.finished:
            return
        if t.flow and t.tid in self.sched:
            self.sched.set_ready(t.tid, t.head_bytes(time.monotonic()))
        self.wake()
