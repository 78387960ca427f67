"""Which transfer to a destination sends its next chunk: pure logic, clock injected.

Classes:
  * ``high``: strict priority over the others; earliest deadline first inside the class (no deadline
    sorts last), then arrival order.
  * ``normal`` and ``low``: deficit round robin between the two classes (quantum per class, in bytes),
    arrival order inside a class.
  * aging: when a normal or low transfer has had a chunk ready for ``max_wait_s`` without being served
    while high traffic holds the link, it is served next anyway, so nothing starves.

The scheduler knows nothing about sockets. The owner tells it which transfers exist (``add``/``remove``)
and the size of each one's next ready chunk (``set_ready``; 0 = nothing ready now), and asks ``pick()``
for the transfer whose head chunk goes next. ``pick`` charges that chunk; the owner then sends it and
calls ``set_ready`` again with the size of the following chunk.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Optional

PRIORITIES = ("high", "normal", "low")
DRR_CLASSES = ("normal", "low")


@dataclass
class _Flow:
    tid: Hashable
    priority: str
    deadline: float            # absolute, on the scheduler's clock; inf = none
    order: int                 # arrival order
    head: int = 0              # bytes of the next ready chunk; 0 = not ready
    ready_since: float = math.inf


@dataclass
class SchedulerStats:
    picks: Dict[str, int] = field(default_factory=lambda: {p: 0 for p in PRIORITIES})
    bytes: Dict[str, int] = field(default_factory=lambda: {p: 0 for p in PRIORITIES})
    aged: int = 0              # picks of normal/low forced by aging while high was waiting


class Scheduler:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        quantum: Optional[Dict[str, int]] = None,
        max_wait_s: float = 0.5,
    ):
        self.clock = clock
        self.quantum = dict(quantum or {"normal": 3 << 20, "low": 1 << 20})
        for cls in DRR_CLASSES:
            if self.quantum.get(cls, 0) <= 0:
                raise ValueError(f"quantum for {cls!r} must be positive")
        self.max_wait_s = float(max_wait_s)
        self._flows: Dict[Hashable, _Flow] = {}
        self._order = itertools.count()
        self._deficit = {cls: 0 for cls in DRR_CLASSES}
        self._ptr = 0                 # index into DRR_CLASSES of the class whose turn it is
        self._turn_started = False
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ membership
    def add(self, tid: Hashable, priority: str = "normal", deadline: Optional[float] = None) -> None:
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; expected one of {PRIORITIES}")
        if tid in self._flows:
            raise KeyError(f"transfer {tid!r} already scheduled")
        self._flows[tid] = _Flow(tid, priority, math.inf if deadline is None else float(deadline),
                                 next(self._order))

    def remove(self, tid: Hashable) -> None:
        self._flows.pop(tid, None)

    def __contains__(self, tid: Hashable) -> bool:
        return tid in self._flows

    def __len__(self) -> int:
        return len(self._flows)

    def set_ready(self, tid: Hashable, head_bytes: int) -> None:
        """The transfer's next chunk has ``head_bytes`` bytes (0: nothing to send now)."""
        flow = self._flows[tid]
        head_bytes = int(head_bytes)
        if head_bytes > 0 and flow.head <= 0:
            flow.ready_since = self.clock()
        elif head_bytes <= 0:
            flow.ready_since = math.inf
        flow.head = max(head_bytes, 0)

    # ------------------------------------------------------------------ queries
    def has_ready(self) -> bool:
        return any(f.head > 0 for f in self._flows.values())

    def depth(self) -> Dict[str, int]:
        """Number of transfers with a chunk ready, per class."""
        out = {p: 0 for p in PRIORITIES}
        for f in self._flows.values():
            if f.head > 0:
                out[f.priority] += 1
        return out

    def _ready(self, cls: str):
        return [f for f in self._flows.values() if f.priority == cls and f.head > 0]

    # ------------------------------------------------------------------ the decision
    def pick(self) -> Optional[Hashable]:
        """The transfer whose head chunk should be sent next, or None if nothing is ready."""
        now = self.clock()
        high = self._ready("high")
        drr_ready = {cls: self._ready(cls) for cls in DRR_CLASSES}
        any_drr = any(drr_ready.values())
        if high and any_drr and self.max_wait_s >= 0:
            oldest = min((f for fl in drr_ready.values() for f in fl), key=lambda f: (f.ready_since, f.order))
            if now - oldest.ready_since >= self.max_wait_s:
                self.stats.aged += 1
                return self._charge(oldest, aged=True)
        if high:
            flow = min(high, key=lambda f: (f.deadline, f.order))
            return self._charge(flow)
        if not any_drr:
            return None
        return self._drr(drr_ready)

    def _drr(self, drr_ready) -> Hashable:
        for _ in range(4 * len(DRR_CLASSES) + 2):
            cls = DRR_CLASSES[self._ptr]
            flows = drr_ready[cls]
            if not flows:
                self._deficit[cls] = 0
                self._next_class()
                continue
            if not self._turn_started:
                self._deficit[cls] += self.quantum[cls]
                self._turn_started = True
            flow = min(flows, key=lambda f: f.order)
            if self._deficit[cls] >= flow.head:
                self._deficit[cls] -= flow.head
                return self._charge(flow)
            self._next_class()
        # A chunk larger than several quanta: serve it rather than spin.
        cls = DRR_CLASSES[self._ptr]
        flows = drr_ready[cls] or next(v for v in drr_ready.values() if v)
        flow = min(flows, key=lambda f: f.order)
        self._deficit[flow.priority] = 0
        return self._charge(flow)

    def _next_class(self) -> None:
        self._ptr = (self._ptr + 1) % len(DRR_CLASSES)
        self._turn_started = False

    def _charge(self, flow: _Flow, aged: bool = False) -> Hashable:
        if aged and flow.priority in DRR_CLASSES:
            # The aged chunk still counts against its class's share.
            self._deficit[flow.priority] -= flow.head
        self.stats.picks[flow.priority] += 1
        self.stats.bytes[flow.priority] += flow.head
        flow.head = 0                      # the owner calls set_ready with the next chunk
        flow.ready_since = math.inf
        return flow.tid
