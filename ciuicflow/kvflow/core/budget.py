"""Bounded memory: buffered bytes per peer and in total (asyncio; one event loop owns it)."""
from __future__ import annotations

import asyncio
from typing import Dict, List


class MemoryBudget:
    def __init__(self, total_cap: int, peer_cap: int, on_change=None):
        self.total_cap = int(total_cap)
        self.peer_cap = int(peer_cap)
        self.used = 0
        self.peak = 0
        self.per_peer: Dict[str, int] = {}
        self.peak_per_peer: Dict[str, int] = {}
        self._waiters: List[asyncio.Future] = []
        self._on_change = on_change

    def fits(self, peer: str, n: int) -> bool:
        return self.used + n <= self.total_cap and self.per_peer.get(peer, 0) + n <= self.peer_cap

    def try_reserve(self, peer: str, n: int) -> bool:
        if n and not self.fits(peer, n):
            return False
        self.used += n
        self.per_peer[peer] = self.per_peer.get(peer, 0) + n
        self.peak = max(self.peak, self.used)
        self.peak_per_peer[peer] = max(self.peak_per_peer.get(peer, 0), self.per_peer[peer])
        if self._on_change:
            self._on_change(peer, self.per_peer[peer], self.used)
        return True

    async def reserve(self, peer: str, n: int, timeout: float) -> bool:
        """Wait (backpressure) until ``n`` bytes fit; False after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.try_reserve(peer, n):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            fut = loop.create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
        return True

    def release(self, peer: str, n: int) -> None:
        if n <= 0:
            return
        self.used -= n
        self.per_peer[peer] = self.per_peer.get(peer, 0) - n
        assert self.used >= 0 and self.per_peer[peer] >= 0, "memory budget released more than reserved"
        if self._on_change:
            self._on_change(peer, self.per_peer[peer], self.used)
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def snapshot(self) -> dict:
        return {
            "total_cap": self.total_cap, "peer_cap": self.peer_cap, "used": self.used, "peak": self.peak,
            "per_peer": dict(self.per_peer), "peak_per_peer": dict(self.peak_per_peer),
        }
