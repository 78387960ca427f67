"""Faults for tests and benchmarks of the KV-flow sidecar, injected through its seams rather than its config:

* ``CorruptingTransport`` wraps any peer transport and flips the first byte of 1 in N chunks at random,
  after their checksum was computed (the receiver answers ACK_CORRUPT: the retransmission path);
* ``RateLimit`` is the receiver's emulated slow link: incoming peer frames are read at most ``rate`` bytes/s,
  so the backlog builds up in the real transport buffers, as on a slow link.

``Faults(...).seams()`` are the keyword arguments of ``ciuicflow.kvflow.sidecar.app.Sidecar`` (and ``serve``)
that install them. A sidecar process gets them from its ``--test-corrupt-every N`` and ``--link-rate RATE``
flags; ``Faults(...).flags()`` writes those flags for a test or benchmark that starts one.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

from ciuicflow.kvflow.transports.base import Stream, Transport


class CorruptingStream(Stream):
    def __init__(self, inner: Stream, every: int, rng: random.Random):
        self.inner, self.every, self.rng = inner, every, rng
        self.kind = inner.kind

    async def send(self, frame) -> None:
        await self.inner.send(frame)

    async def send_chunk(self, head, data) -> None:
        if data and self.rng.random() * self.every < 1.0:
            data = bytes([data[0] ^ 0xFF]) + bytes(data[1:])
        await self.inner.send_chunk(head, data)

    async def finish_sending(self) -> None:
        await self.inner.finish_sending()

    def replies(self):
        return self.inner.replies()

    def abort(self) -> None:
        self.inner.abort()


class CorruptingTransport(Transport):
    """``inner``, with 1 in ``every`` chunks corrupted (a seeded RNG shared by the transport's streams)."""

    def __init__(self, inner: Transport, every: int, rng: random.Random):
        self.inner, self.every, self.rng = inner, every, rng
        self.kind = inner.kind

    async def open(self) -> Stream:
        return CorruptingStream(await self.inner.open(), self.every, self.rng)


class RateLimit:
    """A token bucket: ``await consume(n)`` returns once ``n`` more bytes fit ``rate`` bytes/s (bursts up to
    ``burst``). Clock injected; one waiter at a time, in order."""

    def __init__(self, rate: float, burst: int = 64 << 10, clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate)
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.stamp = clock()
        self._lock = asyncio.Lock()

    def take(self, n: int) -> float:
        """Take ``n`` bytes' tokens now; how long the taker must wait (0: none)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        return -self.tokens / self.rate if self.tokens < 0 else 0.0

    async def consume(self, n: int) -> None:
        async with self._lock:
            wait = self.take(n)
            if wait:
                await asyncio.sleep(wait)


@dataclass(frozen=True)
class Faults:
    corrupt_every: int = 0      # corrupt 1 in N chunks sent (0: none)
    link_rate: int = 0          # read incoming peer traffic at most this many bytes/s (0: unlimited)
    seed: int = 12345

    def seams(self) -> Dict[str, object]:
        """The Sidecar keyword arguments that inject these faults."""
        out: Dict[str, object] = {}
        if self.corrupt_every:
            rng = random.Random(self.seed)
            out["wrap_transport"] = lambda transport: CorruptingTransport(transport, self.corrupt_every, rng)
        if self.link_rate:
            out["inbound_throttle"] = RateLimit(self.link_rate).consume
        return out

    def flags(self) -> List[str]:
        """The sidecar command-line flags that make a sidecar process inject these faults."""
        out: List[str] = []
        if self.corrupt_every:
            out += ["--test-corrupt-every", str(self.corrupt_every)]
        if self.link_rate:
            out += ["--link-rate", str(int(self.link_rate))]
        return out
