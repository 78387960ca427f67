"""Discovery through etcd: this sidecar's registration under a lease, and a watch of everyone's.

* Registration: ``PREFIX/NAME`` -> the entry's JSON (entry.py), attached to a lease of ``ttl_s`` that a
  keep-alive stream refreshes every third of it. A sidecar that dies stops refreshing, etcd deletes the
  key when the lease runs out, and every watcher sees the delete: the registry's notion of "alive" is
  the lease, with no heartbeat of our own. The load in the value is put again when it changed, at most
  every ``load_interval_s`` (a router reads a sample, so sampling it is the honest way; docs/discovery.md).
* Watch: one range read of the prefix (at most ``max_peers`` + 1 keys), handed over whole
  (``on_snapshot``), then a watch from the next revision, each event handed over as it comes
  (``on_put`` / ``on_delete``). Nobody polls.
* etcd unreachable or restarted: the streams are opened again with backoff, and in the meantime peers
  stay as they are (the links between sidecars do not go through etcd). After a reconnect the range is
  read again, so what changed meanwhile is caught up; a lease that etcd no longer knows is granted
  again and the entry put again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Dict, Optional

from .entry import Entry, EntryError, decode, key_name
from .etcd import EtcdClient, EtcdError, EtcdTarget

log = logging.getLogger("ciuicflow.kvflow.discovery")

BACKOFF_MAX_S = 2.0             # between tries to reach etcd; at most a quarter of the TTL (see _backoff)


class EtcdRegistry:
    """Registers ``me()`` (the current entry: its load changes) under ``target``; reports the others to
    ``on_snapshot(dict name -> Entry)``, ``on_put(Entry)`` and ``on_delete(name)``."""

    def __init__(self, target: EtcdTarget, me: Callable[[], Entry], *, ttl_s: int, load_interval_s: float,
                 max_peers: int, on_snapshot, on_put, on_delete):
        self.target = target
        self.prefix = target.key_prefix
        self.me = me
        self.ttl_s = int(ttl_s)
        # A restarted etcd extends every lease by its TTL (and about a second): the keep-alive must be back
        # within that, so the retries are never further apart than a quarter of the TTL.
        self.backoff_max_s = min(BACKOFF_MAX_S, self.ttl_s / 4)
        self.load_interval_s = load_interval_s
        self.max_peers = max_peers
        self.on_snapshot, self.on_put, self.on_delete = on_snapshot, on_put, on_delete
        self.client = EtcdClient(target.endpoints)
        self.lease: Optional[int] = None
        self.registered = asyncio.Event()
        self.watching = asyncio.Event()
        self.stats = {"registrations": 0, "watch_starts": 0, "etcd_errors": 0, "rejected_entries": 0}
        self._bad: Dict[bytes, int] = {}        # key -> mod revision already logged as rejected
        self._tasks = []

    @property
    def key(self) -> bytes:
        return self.prefix + self.me().name.encode()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._register_loop(), name="discovery-register"),
                       asyncio.create_task(self._watch_loop(), name="discovery-watch")]

    async def stop(self) -> None:
        """Leave the registry at once (the lease revoked: peers drop this sidecar now, not after the TTL)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.lease:
            try:
                await self.client.revoke(self.lease)
            except EtcdError as exc:
                log.info("discovery: could not revoke the lease (%s); it expires within %ds", exc, self.ttl_s)
        await self.client.close()

    def _error(self, what: str, exc: Exception) -> None:
        self.stats["etcd_errors"] += 1
        log.warning("discovery: %s: %s (peers are kept; retrying)", what,
                    exc if isinstance(exc, EtcdError) else f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ registration
    async def _register_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                if self.lease is None:
                    self.lease = await self.client.grant(self.ttl_s)
                entry = self.me()
                await self.client.put(self.key, entry.encode(), self.lease)
                self.stats["registrations"] += 1
                self.registered.set()
                backoff = 0.1
                log.info("discovery: registered %s as %s at %s (lease %x, ttl %ds)", entry.name, entry.role,
                         entry.peer, self.lease, self.ttl_s)
                keepalive = asyncio.create_task(self.client.keep_alive(self.lease, self.ttl_s / 3))
                publisher = asyncio.create_task(self._publish_load(entry))
                done, _ = await asyncio.wait({keepalive, publisher}, return_when=asyncio.FIRST_COMPLETED)
                for task in (keepalive, publisher):
                    task.cancel()
                await asyncio.gather(keepalive, publisher, return_exceptions=True)
                for task in done:
                    task.result()       # raises the EtcdError that ended it
                log.warning("discovery: etcd no longer knows lease %x; registering again", self.lease)
                self.lease = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:    # noqa: BLE001 - EtcdError, or anything else: never stop registering
                self.registered.clear()
                self._error("registration", exc)
                if "lease not found" in str(exc):
                    self.lease = None           # expired while etcd was out of reach: a new one, at once
                    continue
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def _publish_load(self, published: Entry) -> None:
        """Put the entry again when its load changed (sampled every ``load_interval_s``)."""
        while True:
            await asyncio.sleep(self.load_interval_s)
            entry = self.me()
            if entry != published:
                await self.client.put(self.key, entry.encode(), self.lease)
                published = entry

    # ------------------------------------------------------------------ watch
    def _parse(self, kv) -> Optional[Entry]:
        name = key_name(self.prefix, kv.key)
        try:
            if name is None:
                raise EntryError("key is not PREFIX/NAME with a valid name")
            return decode(name, kv.value)
        except EntryError as exc:
            if self._bad.get(kv.key) != kv.mod_revision:        # once per version of a key
                if len(self._bad) > 4 * self.max_peers:
                    self._bad.clear()
                self._bad[kv.key] = kv.mod_revision
                self.stats["rejected_entries"] += 1
                log.warning("discovery: entry %r ignored: %s", kv.key[:160], exc)
            return None

    async def _watch_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                kvs, more, revision = await self.client.range_prefix(self.prefix, self.max_peers + 1)
                if more or len(kvs) > self.max_peers:
                    log.warning("discovery: more than %d entries under %s: only the first %d are taken",
                                self.max_peers, self.target.prefix, self.max_peers)
                    kvs = kvs[: self.max_peers]
                snapshot = {}
                for kv in kvs:
                    entry = self._parse(kv)
                    if entry is not None:
                        snapshot[entry.name] = entry
                await self.on_snapshot(snapshot)
                self.stats["watch_starts"] += 1
                async for reply in self.client.watch(self.prefix, revision + 1):
                    if reply.created:
                        self.watching.set()
                        backoff = 0.1
                    if reply.canceled or reply.compact_revision:
                        raise EtcdError(f"watch canceled ({reply.cancel_reason or 'compacted'}): reading again")
                    for event in reply.events:
                        if event.type == event.DELETE:
                            name = key_name(self.prefix, event.kv.key)
                            if name is not None:
                                await self.on_delete(name)
                        else:
                            entry = self._parse(event.kv)
                            if entry is not None:
                                await self.on_put(entry)
                            else:       # a valid entry overwritten by a bad one is gone
                                name = key_name(self.prefix, event.kv.key)
                                if name is not None:
                                    await self.on_delete(name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:    # noqa: BLE001 - EtcdError, or anything else: never stop watching
                self.watching.clear()
                self._error("watch", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
