"""From registry entries to peers: each entry is checked (identify.py) before it becomes a peer, and a peer
whose entry goes is removed. The owner of the discovered entries (``entries``: what the registry holds,
valid; ``adopted``: those that proved their name and are peers now).

Told by the registry (registry.py) of a snapshot, a put or a delete; tells the sidecar's ``Peers``
(sidecar/peers.py) to add or remove a sender. An entry is ignored, and logged, when it names this sidecar
or a static ``--peer``, when ``max_peers`` are adopted already, or when its answer does not prove its name;
a peer that cannot be asked yet (still starting) is asked again with backoff while its entry stands.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Dict, Optional

import grpc

from .entry import Entry, summary
from .identify import Mismatch, identify

log = logging.getLogger("ciuicflow.kvflow.discovery")

RETRY_MAX_S = 1.0


class Membership:
    """``peers``: the sidecar's Peers (add / remove / static); ``channel(address, name)``: a gRPC channel
    to a candidate (TLS checked against ``name``); ``secret_for(name)``: the pairwise secret shared with
    ``name`` (None: none); ``tls``: mutual TLS binds names; ``max_peers``: discovered peers at most."""

    def __init__(self, me: str, peers, channel: Callable[[str, str], grpc.aio.Channel],
                 secret_for: Callable[[str], Optional[str]], tls: bool, max_peers: int):
        self.me = me
        self.peers = peers
        self.channel = channel
        self.secret_for = secret_for
        self.tls = tls
        self.max_peers = max_peers
        self.entries: Dict[str, Entry] = {}
        self.adopted: Dict[str, Entry] = {}
        self.ignored: Dict[str, str] = {}           # name -> why (for Stats; bounded by max_peers)
        self.refused: Dict[str, Entry] = {}         # entries whose peer did not prove the name
        self._checks: Dict[str, asyncio.Task] = {}
        self.changed = asyncio.Event()              # set on every adoption or removal (tests, routers)

    # ------------------------------------------------------------------ told by the registry
    async def on_snapshot(self, entries: Dict[str, Entry]) -> None:
        for name in list(self.entries):
            if name not in entries:
                await self.on_delete(name)
        for entry in entries.values():
            await self.on_put(entry)

    async def on_put(self, entry: Entry) -> None:
        name = entry.name
        if name == self.me:
            return
        if self.peers.is_static(name):
            self._ignore(name, "a static --peer has this name")
            return
        if name not in self.entries and len(self.entries) >= self.max_peers:
            self._ignore(name, f"{self.max_peers} discovered peers already (--max-discovered-peers)")
            return
        previous = self.entries.get(name)
        self.entries[name] = entry
        adopted = self.adopted.get(name)
        if adopted is not None and adopted.same_endpoint(entry):
            self.adopted[name] = entry          # the load changed: nothing to reconnect
            return
        if previous is not None and previous.same_endpoint(entry) and name in self._checks:
            return                              # being checked already
        refused = self.refused.get(name)
        if refused is not None and refused.same_endpoint(entry):
            return      # refused already: a new load figure does not make it ask again (nor anyone else)
        self._start_check(entry)

    async def on_delete(self, name: str) -> None:
        self.entries.pop(name, None)
        self.refused.pop(name, None)
        self.ignored.pop(name, None)
        task = self._checks.pop(name, None)
        if task is not None:
            task.cancel()
        if self.adopted.pop(name, None) is not None:
            await self.peers.remove(name, "its registration ended (lease expired or deregistered)")
            self.changed.set()

    # ------------------------------------------------------------------ checks
    def _ignore(self, name: str, why: str) -> None:
        if self.ignored.get(name) != why:
            log.warning("discovery: entry %r ignored: %s", name, why)
            if len(self.ignored) < 4 * self.max_peers:
                self.ignored[name] = why

    def _start_check(self, entry: Entry) -> None:
        old = self._checks.pop(entry.name, None)
        if old is not None:
            old.cancel()
        self._checks[entry.name] = asyncio.create_task(self._check(entry), name=f"identify-{entry.name}")

    async def _check(self, entry: Entry) -> None:
        name = entry.name
        delay = 0.05
        channel = self.channel(entry.peer, name)
        try:
            while True:
                try:
                    await identify(channel, self.me, name, entry.peer, self.secret_for(name), self.tls)
                    break
                except Mismatch as exc:
                    self._ignore(name, f"its peer at {entry.peer} does not prove the name: {exc}")
                    self.refused[name] = entry
                    if name in self.adopted:        # it moved to an address that cannot prove it
                        del self.adopted[name]
                        await self.peers.remove(name, "its new registration does not prove its name")
                        self.changed.set()
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        self._ignore(name, f"its peer at {entry.peer} cannot prove its name (no Identify)")
                        self.refused[name] = entry
                        return
                    details = (exc.details() or "").lower()
                    if any(word in details for word in ("handshake", "certificate", "ssl", "verification")):
                        # mutual TLS refused the peer (its certificate does not carry the name, or the CA's
                        # signature): ignored, and asked again slowly in case its certificate is renewed
                        self._ignore(name, f"TLS with its peer at {entry.peer} fails: {exc.details()[:200]}")
                        delay = RETRY_MAX_S
                    log.debug("discovery: %s at %s not answering yet: %s %s", name, entry.peer, exc.code().name,
                              exc.details())
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
        finally:
            await channel.close()
            if self._checks.get(name) is asyncio.current_task():
                del self._checks[name]
        self.ignored.pop(name, None)
        self.refused.pop(name, None)
        if name in self.adopted:
            await self.peers.remove(name, f"it moved to {entry.peer}")
        self.adopted[name] = entry
        self.peers.add(name, entry.peer, discovered=True)
        log.info("discovery: peer %s (%s) at %s proved its name: adopted", name, entry.role, entry.peer)
        self.changed.set()

    async def close(self) -> None:
        for task in self._checks.values():
            task.cancel()
        await asyncio.gather(*self._checks.values(), return_exceptions=True)

    def snapshot(self) -> dict:
        return {"peers": summary(self.adopted), "pending": sorted(self._checks),
                "ignored": dict(sorted(self.ignored.items())[:32])}
