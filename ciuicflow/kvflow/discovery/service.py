"""A sidecar's discovery (``--discovery etcd://...``): its registration and its view of the others, wired
to the sidecar's ``Peers``; and the answer to ``Identify`` that proves this sidecar's name to the others.

Built by ``sidecar.app.Sidecar.start`` once the peer port is bound (the advertised address defaults to it).
"""
from __future__ import annotations

import logging
from typing import Callable

from ..proto import kvflow_pb2 as pb
from .entry import Entry, Load
from .etcd import parse_target
from .identify import answer
from .membership import Membership
from .registry import EtcdRegistry

log = logging.getLogger("ciuicflow.kvflow.discovery")


class Discovery:
    """``cfg``: the sidecar's settings; ``peers``: its Peers; ``listen``: the peer address as bound (the
    default --advertise); ``load()``: the load to register (entry.Load); ``channel(address, name)``: a
    gRPC channel to a candidate peer, TLS checked against ``name``."""

    def __init__(self, cfg, peers, listen: str, load: Callable[[], Load], channel):
        self.cfg = cfg
        self.address = cfg.advertise or listen
        self.load = load
        self.membership = Membership(cfg.name, peers, channel, cfg.peer_secrets.get, bool(cfg.tls_ca),
                                     cfg.max_discovered_peers)
        m = self.membership
        self.registry = EtcdRegistry(parse_target(cfg.discovery), self.entry, ttl_s=cfg.discovery_ttl_s,
                                     load_interval_s=cfg.discovery_load_s, max_peers=cfg.max_discovered_peers,
                                     on_snapshot=m.on_snapshot, on_put=m.on_put, on_delete=m.on_delete)

    def entry(self) -> Entry:
        return Entry(self.cfg.name, self.cfg.role, self.address, self.cfg.server_url or "", self.load())

    def identity(self, request: pb.IdentifyRequest) -> pb.IdentifyReply:
        """PeerService.Identify's answer: this sidecar's name, proved to the caller (identify.py)."""
        return answer(request, self.cfg.name, self.address, self.cfg.peer_secrets)

    def start(self) -> None:
        log.info("discovery: %s as %s at %s (ttl %ds)", self.cfg.discovery, self.cfg.role, self.address,
                 self.cfg.discovery_ttl_s)
        self.registry.start()

    async def stop(self) -> None:
        await self.registry.stop()
        await self.membership.close()

    def snapshot(self) -> dict:
        return {"target": self.cfg.discovery, "address": self.address, "registered": self.registry.registered.is_set(),
                "watching": self.registry.watching.is_set(), **self.registry.stats, **self.membership.snapshot()}
