"""Bounds on what peers and local clients can make a sidecar hold: pure logic, clock injected.

* ``seconds``: a duration chosen by a peer or client (lease, deadline, timeout), checked and clamped:
  NaN and negative values are refused, infinite or huge ones cut to a maximum (a NaN lease would never
  expire, an infinite one would pin its bytes forever);
* ``chunk_cost``: what a held chunk counts in the memory budget: its bytes, its part descriptions (names,
  shapes, and what each costs parsed) and a fixed overhead, so zero-byte parts and long names are not free;
* ``Labels``: peer names as metric labels and budget accounts, at most ``max_unknown`` names besides the
  configured peers (then "other");
* ``Tickets``: the data plane's one-time tickets, a few per sender and a bounded number in all, expired
  in order without rescanning them all.
"""
from __future__ import annotations

import collections
import math
import secrets
import time
from typing import Callable, Collection, Dict, Optional, Tuple

# What a held chunk costs besides its data (its objects, the frame's buffer and parsed header), and each part
# description besides its serialized bytes (a parsed PartInfo's object and arena, its slot): measured held
# memory, with room to spare, so zero-byte parts count for what they hold, not for the few bytes they take
# on the wire.
CHUNK_OVERHEAD = 768
PART_INFO_OVERHEAD = 384
OTHER = "other"                 # the label (and budget account) of unknown peers past the limit


def seconds(value: float, *, maximum: float, what: str) -> float:
    """``value`` (0: none / the default) checked and clamped to ``maximum``; raises ValueError for NaN or
    a negative value."""
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{what} must be a number >= 0, got {value!r}")
    return min(value, maximum)


def chunk_cost(data_bytes: int, infos=()) -> int:
    """Budget bytes of a chunk of ``data_bytes`` with the part descriptions ``infos`` (PartInfo or None)."""
    return CHUNK_OVERHEAD + int(data_bytes) + sum(PART_INFO_OVERHEAD + i.ByteSize() for i in infos if i is not None)


class Labels:
    """Peer name -> the name it is counted under: itself for a configured peer, and for the first
    ``max_unknown`` other names seen; OTHER after that (an unknown peer cannot make metrics, budget
    accounts or per-peer state grow without limit by inventing names)."""

    def __init__(self, known: Collection[str], max_unknown: int = 32):
        self.known = set(known)
        self.max_unknown = max_unknown
        self._unknown: Dict[str, None] = {}

    def __call__(self, name: str) -> str:
        if name in self.known or name in self._unknown:
            return name
        if len(self._unknown) < self.max_unknown:
            self._unknown[name] = None
            return name
        return OTHER


class Gate:
    """At most ``limit`` at once (streams of one kind): ``enter()`` False when full; ``leave()``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def enter(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count = max(self.count - 1, 0)


class Tickets:
    """One-time tickets handed out by ``DataPlane``: ticket -> (sender name, expiry). At most ``per_source``
    live tickets per sender (a new one retires that sender's oldest) and ``total`` in all (the oldest goes);
    tickets expire in the order they were issued (one TTL for all), so expiry never scans them all."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = 60.0, per_source: int = 8,
                 total: int = 1024):
        self._clock = clock
        self.ttl_s = ttl_s
        self.per_source = per_source
        self.total = total
        self._issued: "collections.OrderedDict[bytes, Tuple[str, float]]" = collections.OrderedDict()
        self._by_source: Dict[str, "collections.OrderedDict[bytes, None]"] = {}

    def __len__(self) -> int:
        return len(self._issued)

    def _forget(self, ticket: bytes) -> Optional[Tuple[str, float]]:
        entry = self._issued.pop(ticket, None)
        if entry is not None:
            mine = self._by_source[entry[0]]
            del mine[ticket]
            if not mine:
                del self._by_source[entry[0]]
        return entry

    def _expire(self, now: float) -> None:
        while self._issued:
            ticket, (_, expiry) = next(iter(self._issued.items()))
            if expiry >= now:
                return
            self._forget(ticket)

    def issue(self, source: str) -> bytes:
        now = self._clock()
        self._expire(now)
        mine = self._by_source.get(source)
        if mine is not None and len(mine) >= self.per_source:
            self._forget(next(iter(mine)))
        while len(self._issued) >= self.total:
            self._forget(next(iter(self._issued)))
        ticket = secrets.token_bytes(24)
        self._issued[ticket] = (source, now + self.ttl_s)
        self._by_source.setdefault(source, collections.OrderedDict())[ticket] = None
        return ticket

    def redeem(self, ticket: bytes) -> Optional[str]:
        entry = self._forget(bytes(ticket))
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]
