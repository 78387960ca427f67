"""Received transfers, held until the local client collects them with ``Recv`` (for at most a lease)."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Dict, List, Optional, Tuple

import grpc

from ..core.limits import chunk_cost
from .spool import SpoolError

log = logging.getLogger("ciuicflow.kvflow.store")

TOMBSTONES = 16384        # outcomes of transfers no longer held (most recent): for late receivers, for senders
#                           asking whether their consumer has a transfer, and to refuse a transfer again


class InChunk:
    """A received chunk: bytes of one part from ``offset``, or, packed, several whole parts back to back
    (``info`` and then ``more``). ``cost``: what it counts in the memory budget (core.limits.chunk_cost:
    data, part descriptions and overhead)."""
    __slots__ = ("part", "offset", "data", "info", "crc", "part_nbytes", "more", "cost")

    def __init__(self, part, offset, data, info, crc, part_nbytes, more=()):
        self.part = part
        self.offset = offset
        self.data = data
        self.info = info
        self.crc = crc
        self.part_nbytes = part_nbytes
        self.more = tuple(more)
        self.cost = chunk_cost(len(data), (info, *self.more))

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


class InTransfer:
    """One received transfer, from the authenticated peer ``source``; its memory is counted under
    ``account`` (the source, or core.limits.OTHER past the unknown peers' limit)."""

    def __init__(self, key: str, source: str, uuid: str, priority: str, payload_kind: str, lease_s: float,
                 deadline: Optional[float], account: Optional[str] = None):
        self.key = key
        self.source = source
        self.account = account or source
        self.uuid = uuid
        self.priority = priority
        self.payload_kind = payload_kind
        self.lease_s = lease_s
        self.deadline = deadline
        self.chunks: List[InChunk] = []
        self.bytes = 0                    # payload bytes held
        self.cost = 0                     # what they count in the memory budget (reserved)
        self.total: Optional[int] = None
        self.num_parts: Optional[int] = None
        self.complete = False
        self.failed: Optional[Tuple[grpc.StatusCode, str]] = None
        now = time.monotonic()
        self.created = now
        self.last_activity = now
        self.completed_at: Optional[float] = None
        self.readers = 0
        self.read_at = now                # when a reader last made progress
        self.reader_tasks: dict = {}      # the Recv calls reading it -> the status that ended one (None)
        self.delivered = False            # fully delivered to a Recv that acknowledges itself (manual_ack)
        self.attached = None              # the peer stream feeding it, None while its sender is away
        self.detached_at: Optional[float] = None
        self.truncations: List[Tuple[int, int]] = []    # (generation, seq)
        self.generation = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    # ------------------------------------------------------------------ the stream that feeds it
    def attach(self, stream_id, uuid: str) -> None:
        """(Re-)opened as ``uuid`` on stream ``stream_id``; not yet complete, it is committed again."""
        if not self.complete:
            self.total = self.num_parts = None
        self.uuid = uuid
        self.attached = stream_id
        self.detached_at = None
        self.last_activity = time.monotonic()

    def detach(self, stream_id) -> None:
        """Stream ``stream_id`` ended: if it fed this transfer, its sender is away from now on."""
        if self.attached is stream_id:
            self.attached = None
            self.detached_at = time.monotonic()

    def touch(self) -> None:
        """Its sender made progress (the lease and the resume timeout count from now)."""
        self.last_activity = time.monotonic()

    def committed(self, total: int, num_parts: int) -> None:
        """Its sender says it has ``total`` chunks in ``num_parts`` parts."""
        self.total, self.num_parts = total, num_parts

    def restore_chunk(self, chunk: "InChunk") -> None:
        """A chunk read back from the spool (spool_restore.py; its memory reserved there)."""
        self.chunks.append(chunk)
        self.bytes += len(chunk.data)
        self.cost += chunk.cost

    def restore_complete(self) -> None:
        """It was complete when the spool wrote it, and every chunk came back."""
        self.complete = True
        self.completed_at = time.monotonic()

    # ------------------------------------------------------------------ the Recv calls reading it
    def start_reading(self, task) -> None:
        self.readers += 1
        self.read_at = time.monotonic()
        self.reader_tasks[task] = None

    def ended_with(self, task) -> Optional[Tuple[grpc.StatusCode, str]]:
        """The status the store ended ``task``'s reading with (Store.end_readers), None if it did not."""
        return self.reader_tasks.get(task)

    def stop_reading(self, task) -> None:
        self.reader_tasks.pop(task, None)
        self.readers -= 1
        self.last_activity = time.monotonic()

    def read_progress(self) -> None:
        self.read_at = time.monotonic()

    def mark_delivered(self) -> None:
        """Fully delivered to a Recv that acknowledges itself: kept until Acknowledge or its lease."""
        self.delivered = True

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
    """Received transfers by (source, key), with leases (``lease_s``: the default); memory counted in
    ``budget``. A transfer whose sender went away fails after ``resume_timeout_s``. ``spool``: a durable
    copy (optional).

    Keys are scoped by the authenticated source: a peer can neither take another peer's key first (its
    transfer is another entry) nor resume or replace another peer's transfer."""

    def __init__(self, budget, metrics, lease_s: float, resume_timeout_s: float, labels=lambda name: name):
        self.budget = budget
        self.labels = labels            # peer name -> its budget account and metric label (core.limits.Labels)
        self.metrics = metrics
        self.lease_s = lease_s
        self.resume_timeout_s = resume_timeout_s
        self.entries: Dict[Tuple[str, str], InTransfer] = {}         # (source, key) -> transfer
        self.by_key: Dict[str, Dict[str, InTransfer]] = {}            # key -> source -> transfer
        self.per_account: "collections.Counter[str]" = collections.Counter()   # transfers held per account
        self.tombstones: "collections.OrderedDict[Tuple[str, str], tuple]" = collections.OrderedDict()
        self._arrival = asyncio.Event()
        self._tomb_sources: Dict[str, Dict[str, None]] = {}    # key -> sources of its tombstones, oldest first
        self.completed = 0
        self.expired = 0
        self.collected = 0
        self.spool = None

    def use_spool(self, spool) -> None:
        """Keep a durable copy in ``spool`` from now on (app: after restoring what it held)."""
        self.spool = spool

    def notify_all(self) -> None:
        """Wake every Recv waiting on a transfer (shutdown: they see it)."""
        for entry in list(self.entries.values()):
            entry.notify()

    def incoming(self) -> int:
        """Transfers being received (not yet complete)."""
        return sum(1 for e in self.entries.values() if not e.complete)

    # ------------------------------------------------------------------ membership
    def get(self, source: str, key: str) -> Optional[InTransfer]:
        return self.entries.get((source, key))

    def find(self, key: str, source: str = "") -> List[InTransfer]:
        """The transfers with ``key`` (from ``source`` only, if given)."""
        if source:
            entry = self.entries.get((source, key))
            return [entry] if entry is not None else []
        return list(self.by_key.get(key, {}).values())

    def holds(self, entry: InTransfer) -> bool:
        return self.entries.get((entry.source, entry.key)) is entry

    def tombstone(self, key: str, source: str = "") -> Optional[tuple]:
        """The outcome of the last transfer with ``key`` (from ``source``, if given) no longer held."""
        if source:
            return self.tombstones.get((source, key))
        sources = self._tomb_sources.get(key)
        return self.tombstones.get((next(reversed(sources)), key)) if sources else None

    def insert(self, entry: InTransfer) -> None:
        """Hold ``entry`` (a new transfer, or one restored from the spool)."""
        self.entries[(entry.source, entry.key)] = entry
        self.by_key.setdefault(entry.key, {})[entry.source] = entry
        self.per_account[entry.account] += 1
        self._untomb((entry.source, entry.key))

    def _remove(self, entry: InTransfer) -> None:
        if self.entries.get((entry.source, entry.key)) is entry:
            del self.entries[(entry.source, entry.key)]
            self.per_account[entry.account] -= 1
            if not self.per_account[entry.account]:
                del self.per_account[entry.account]
            sources = self.by_key.get(entry.key)
            if sources is not None:
                sources.pop(entry.source, None)
                if not sources:
                    del self.by_key[entry.key]

    def add(self, entry: InTransfer) -> None:
        """Hold a new transfer; raises spool.SpoolError (nothing held) when its files cannot be made."""
        if self.spool:
            self.spool.create(entry)
        self.insert(entry)
        self._arrival.set()
        self._arrival = asyncio.Event()

    def _tombstone(self, entry: InTransfer, reason: str, code=None, message: str = "") -> None:
        self.restore_tombstone(entry.source, entry.key, reason, entry.uuid, code, message)
        if self.spool and reason in ("collected", "expired"):       # durable: no second delivery after a restart
            try:
                self.spool.tombstone(entry.source, entry.key, reason, entry.uuid, TOMBSTONES)
                if self.spool.needs_compaction(TOMBSTONES):
                    self.spool.compact(self.tombstone_records())
            except SpoolError:
                pass        # logged by the spool; the outcome is still remembered here until a restart

    def restore_tombstone(self, source: str, key: str, reason: str, uuid: str, code=None, message: str = ""):
        where = (source, key)
        self._untomb(where)
        self.tombstones[where] = (reason, uuid, code, message)
        self._tomb_sources.setdefault(key, {})[source] = None     # an ordered set
        while len(self.tombstones) > TOMBSTONES:
            self._untomb(next(iter(self.tombstones)))

    def tombstone_records(self):
        """(source, key, reason, uuid) of the durable outcomes, oldest first (the spool's log)."""
        return [(s, k, t[0], t[1]) for (s, k), t in self.tombstones.items() if t[0] in ("collected", "expired")]

    def _untomb(self, where: Tuple[str, str]) -> None:
        if self.tombstones.pop(where, None) is not None:
            sources = self._tomb_sources[where[1]]
            del sources[where[0]]
            if not sources:
                del self._tomb_sources[where[1]]

    def drop(self, entry: InTransfer, reason: str) -> None:
        """Forget ``entry``. One not complete is failed first: the stream still feeding it is refused from
        now on (its chunks are not held, its commit is not acknowledged)."""
        if not entry.complete and entry.failed is None:
            entry.failed = (grpc.StatusCode.ABORTED, f"transfer {entry.key!r} was dropped here ({reason})")
            self.metrics.transfers.labels(entry.account, entry.priority, "recv", "ABORTED").inc()
        self._remove(entry)
        self._release(entry)
        if self.spool:
            self.spool.delete(entry)
        code, message = entry.failed if entry.failed else (None, "")
        self._tombstone(entry, reason, code, message)
        entry.notify()

    def hold(self, entry: InTransfer, chunk: InChunk) -> bool:
        """Append ``chunk`` to ``entry`` if its cost fits the memory budget (False: it does not)."""
        if not self.budget.try_reserve(entry.account, chunk.cost):
            return False
        entry.chunks.append(chunk)
        entry.bytes += len(chunk.data)
        entry.cost += chunk.cost
        return True

    def persist(self, entry: InTransfer, chunk: InChunk) -> bool:
        """Write the chunk just held to the spool, if any (False: it cannot be, and ``entry`` failed)."""
        try:
            if self.spool:
                self.spool.append(entry, chunk)
            return True
        except SpoolError as exc:
            self.fail(entry, exc.code, exc.message)
            return False

    def _release(self, entry: InTransfer) -> None:
        if entry.cost:
            self.budget.release(entry.account, entry.cost)
        entry.bytes = entry.cost = 0
        entry.chunks = []

    def truncate(self, entry: InTransfer, seq: int) -> None:
        dropped = entry.chunks[seq:]
        n = sum(len(c.data) for c in dropped)
        cost = sum(c.cost for c in dropped)
        del entry.chunks[seq:]
        entry.bytes -= n
        entry.cost -= cost
        self.budget.release(entry.account, cost)
        entry.generation += 1
        entry.truncations.append((entry.generation, seq))
        try:
            if self.spool:
                self.spool.rewrite(entry)
        except SpoolError as exc:
            self.fail(entry, exc.code, exc.message)

    def fail(self, entry: InTransfer, code: grpc.StatusCode, message: str) -> None:
        if entry.failed or entry.complete:
            return
        log.info("incoming transfer %r from %s failed: %s %s", entry.key, entry.source, code.name, message)
        entry.failed = (code, message)
        entry.last_activity = time.monotonic()
        self._release(entry)
        if self.spool:
            self.spool.delete(entry)
        self.metrics.transfers.labels(entry.account, entry.priority, "recv", code.name).inc()
        entry.notify()

    def mark_complete(self, entry: InTransfer) -> bool:
        """Complete (with a spool: durably first); False when the spool cannot say so, and ``entry`` failed."""
        try:
            if self.spool:
                self.spool.complete(entry)
        except SpoolError as exc:
            self.fail(entry, exc.code, exc.message)
            return False
        entry.complete = True
        entry.completed_at = time.monotonic()
        self.completed += 1
        self.metrics.transfers.labels(entry.account, entry.priority, "recv", "OK").inc()
        self.metrics.latency.labels(entry.priority, "recv").observe(entry.completed_at - entry.created)
        entry.notify()
        return True

    def collect(self, entry: InTransfer) -> None:
        self.collected += 1
        self.drop(entry, "collected")

    async def wait_for(self, key: str, deadline: Optional[float], source: str = "") -> List[InTransfer]:
        """The transfers with ``key`` (from ``source``, if given) once there is one; [] at the deadline."""
        while True:
            found = self.find(key, source)
            if found:
                return found
            event = self._arrival
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return []
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return []

    # ------------------------------------------------------------------ leases, deadlines, lost senders
    @staticmethod
    def end_readers(entry: InTransfer, code: grpc.StatusCode, message: str) -> None:
        """End the Recv calls reading ``entry`` with this status, wherever they wait (delivery.deliver
        answers a cancellation it was given a status for with that status, at once)."""
        for task in list(entry.reader_tasks):
            entry.reader_tasks[task] = (code, message)
            task.cancel()

    def sweep(self) -> None:
        now = time.monotonic()
        for entry in list(self.entries.values()):
            if not entry.complete and not entry.failed:
                if entry.deadline is not None and now > entry.deadline:
                    self.fail(entry, grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"transfer {entry.key!r} from {entry.source!r} missed its deadline "
                              f"({len(entry.chunks)} chunks arrived)")
                elif entry.attached is None and entry.detached_at is not None \
                        and now - entry.detached_at > self.resume_timeout_s:
                    self.fail(entry, grpc.StatusCode.UNAVAILABLE,
                              f"sender {entry.source!r} went away mid-transfer and did not come back "
                              f"within {self.resume_timeout_s:g}s")
            lease = entry.lease_s or self.lease_s
            if entry.readers:
                if now - entry.read_at > lease:
                    # a reader that does not read must not keep it past its lease: its Recv is ended
                    log.info("Recv of %r from %s made no progress for %gs: ended", entry.key, entry.source, lease)
                    self.end_readers(entry, grpc.StatusCode.ABORTED,
                                     f"Recv of {entry.key!r} from {entry.source!r} made no progress for {lease:g}s "
                                     "(the transfer's lease): ended")
                continue
            since = entry.completed_at if entry.complete else entry.last_activity
            if now - since > lease:
                if entry.complete:
                    self.expired += 1
                    self.metrics.leases_expired.inc()
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
            "keys": sorted(self.by_key)[:100],
        }
