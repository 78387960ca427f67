"""Faults for tests and benchmarks of the KV-flow sidecar, injected through its seams rather than its config:

* ``CorruptingTransport`` wraps any peer transport and flips the first byte of 1 in N chunks at random,
  after their checksum was computed (the receiver answers ACK_CORRUPT: the retransmission path);
* ``RateLimit`` is the receiver's emulated slow link: incoming peer frames are read at most ``rate`` bytes/s,
  so the backlog builds up in the real transport buffers, as on a slow link.

``Faults(...).seams()`` are the keyword arguments of ``ciuicflow.kvflow.sidecar.app.Sidecar`` (and ``serve``)
that install them. A sidecar process gets them when it runs as this module (LAUNCHER): ``python -m
ciuicflow.testing.kvflow_faults [sidecar flags] [--test-corrupt-every N] [--link-rate RATE]`` is the production
command line (ciuicflow.kvflow.server) plus the fault flags, which it turns into seams. The production entry
point knows no faults. ``Faults(...).flags()`` writes those flags for a test or benchmark that starts one, and
``sidecar_module(args)`` says which module runs a sidecar with ``args``.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from ciuicflow.kvflow.transports.base import Stream, Transport

SIDECAR = "ciuicflow.kvflow.server"             # the production command line
LAUNCHER = "ciuicflow.testing.kvflow_faults"    # it, with the fault flags (main below)
FLAGS = ("--test-corrupt-every", "--link-rate")


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


def sidecar_module(args: Sequence[str]) -> str:
    """The module a sidecar with command-line ``args`` runs as: LAUNCHER when they name a fault, else the
    production entry point (so that tests without faults run exactly what production runs)."""
    return LAUNCHER if any(str(a).split("=", 1)[0] in FLAGS for a in args) else SIDECAR


def main(argv: Optional[List[str]] = None) -> int:
    """The sidecar's command line with the fault flags: they become seams, the rest goes to production's."""
    from ciuicflow.kvflow import server
    from ciuicflow.kvflow.sidecar.config import parse_size
    p = argparse.ArgumentParser(prog=LAUNCHER, add_help=False, allow_abbrev=False)
    p.add_argument("--test-corrupt-every", type=int, default=0, metavar="N",
                   help="corrupt 1 in N chunks sent (at random), to exercise checksum retransmits")
    p.add_argument("--link-rate", default="0", help="emulate a slow link: read incoming peer traffic at most "
                                                     "this fast, e.g. 100MB or 800Mbit")
    known, rest = p.parse_known_args(argv)
    try:
        if known.test_corrupt_every < 0:
            raise ValueError("--test-corrupt-every must be >= 0")
        faults = Faults(corrupt_every=known.test_corrupt_every,
                        link_rate=parse_size(known.link_rate, what="--link-rate"))
    except ValueError as exc:
        print(f"{LAUNCHER}: {exc}", file=sys.stderr)
        return 2
    return server.main(rest, **faults.seams())


if __name__ == "__main__":
    sys.exit(main())
