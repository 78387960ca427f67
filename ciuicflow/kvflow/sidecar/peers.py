"""Who this sidecar sends to: the owner of the peer senders (``sender(name)``, ``all()``), of their channels,
and of the names a receiving stream may claim (``known``).

Peers come from ``--peer`` (for the process's life) and from discovery (added once they proved their name,
removed when their registration ends: ciuicflow/kvflow/discovery/). A removed peer's transfers fail at
once, and a send to it is refused with UNAVAILABLE and why, for as long as its name is remembered.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import grpc

from ..proto.messages import AUTH_METADATA, PEER_METADATA
from ..transports.base import Transport
from ..transports.grpc_stream import GrpcStreamTransport, PeerChannel
from ..transports.tcp import TcpTransport
from . import grpc_setup
from .config import parse_hostport
from .peer_sender import PeerSender

log = logging.getLogger("ciuicflow.kvflow")

VANISHED_REMEMBERED = 256       # names of removed peers kept for a clear refusal (oldest forgotten first)
CLOSE_S = 10.0                  # a removed peer's sender and channel get this long to stop


class Peers:
    """Senders to peers, built from ``cfg`` with ``policy``'s credentials; memory from ``budget``.
    ``known``: the set of peer names the receiving side accepts (shared with core.identity.PeerPolicy) and
    ``labels`` counts apart; ``wrap_transport``: the tests' fault seam (app.Sidecar)."""

    def __init__(self, cfg, policy, budget, metrics, known: Set[str], labels,
                 wrap_transport: Optional[Callable[[Transport], Transport]] = None):
        self.cfg = cfg
        self.policy = policy
        self.budget = budget
        self.metrics = metrics
        self.known = known
        self.labels = labels
        self.wrap_transport = wrap_transport
        self.settings = cfg.sender_settings()
        self._senders: Dict[str, PeerSender] = {}
        self._static = set(cfg.peers)
        self._channels: Dict[str, PeerChannel] = {}
        self._vanished: "collections.OrderedDict[str, Tuple[float, str]]" = collections.OrderedDict()
        self._closing: Set[asyncio.Task] = set()     # removed peers' teardowns

    def sender(self, name: str) -> Optional[PeerSender]:
        """The sender to peer ``name``; None when it is no peer now (``refusal`` says why)."""
        return self._senders.get(name)

    def all(self) -> List[PeerSender]:
        return list(self._senders.values())

    def is_static(self, name: str) -> bool:
        """Named by --peer: kept for the process's life, whatever discovery says."""
        return name in self._static

    def _transports(self, name: str, address: str, server_name: Optional[str]) -> List[Transport]:
        """How chunks go to peer ``name``: its TCP data plane when it offers one (not with TLS, which that
        plane lacks, nor with --peer-transport grpc), else the gRPC stream."""
        cfg = self.cfg
        credential = self.policy.credential_for(name)
        md = [(PEER_METADATA, cfg.name)] + ([(AUTH_METADATA, f"Bearer {credential}")] if credential else [])
        channel = PeerChannel(grpc_setup.peer_channel(cfg, address, server_name), md)
        self._channels[name] = channel
        transports: List[Transport] = []
        if cfg.peer_transport == "auto" and not cfg.tls_cert:
            transports.append(TcpTransport(name, parse_hostport(address)[0], channel.data_plane))
        transports.append(GrpcStreamTransport(channel))
        return [self.wrap_transport(t) for t in transports] if self.wrap_transport else transports

    def add(self, name: str, address: str, discovered: bool = False) -> PeerSender:
        """Start sending to ``name`` at ``address`` (a discovered peer: its certificate must carry the name,
        not the address's host)."""
        sender = PeerSender(name, address, self.settings, self.budget, self.metrics,
                            self._transports(name, address, name if discovered else None))
        self._senders[name] = sender
        self.known.add(name)
        self.labels.known.add(name)
        self._vanished.pop(name, None)
        sender.start()
        return sender

    async def remove(self, name: str, reason: str) -> None:
        """Stop sending to ``name``: its transfers fail with UNAVAILABLE (``reason``) and its links close.
        Static peers are never removed."""
        if name in self._static:
            return
        sender = self._senders.pop(name, None)
        self.known.discard(name)
        self._vanished[name] = (time.time(), reason)
        self._vanished.move_to_end(name)
        while len(self._vanished) > VANISHED_REMEMBERED:
            self._vanished.popitem(last=False)
        if sender is None:
            return
        log.info("peer %s removed: %s", name, reason)
        sender.fail_all(grpc.StatusCode.UNAVAILABLE, f"peer {name!r} is gone: {reason}")
        # the teardown runs beside the caller, the registry's watch, whose next events (a peer
        # coming back, others joining) must not wait on a link that may take long to stop
        task = asyncio.create_task(self._close_removed(name, sender, self._channels.pop(name, None)),
                                   name=f"close-peer-{name}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_removed(self, name: str, sender: PeerSender, channel) -> None:
        try:
            await asyncio.wait_for(sender.close(), CLOSE_S)
        except asyncio.TimeoutError:
            log.warning("peer %s: its sender did not stop within %gs after its removal", name, CLOSE_S)
        if channel is not None:
            try:
                await asyncio.wait_for(channel.close(), CLOSE_S)
            except asyncio.TimeoutError:
                log.warning("peer %s: its channel did not close within %gs", name, CLOSE_S)

    def refusal(self, dest: str) -> Tuple[grpc.StatusCode, str]:
        """Why a send to ``dest`` (not a peer now) is refused."""
        if dest in self._vanished:
            when, reason = self._vanished[dest]
            return (grpc.StatusCode.UNAVAILABLE,
                    f"peer {dest!r} is gone ({reason}, {time.time() - when:.1f}s ago)")
        known = ", ".join(sorted(self._senders)) or "none"
        return grpc.StatusCode.NOT_FOUND, f"unknown peer {dest!r} (known: {known})"

    async def close(self, flush_s: float) -> None:
        """Shutdown: let the senders deliver their last frames (the aborts), then close every channel."""
        await asyncio.gather(*(s.close(flush_s=flush_s) for s in self._senders.values()))
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))
        await asyncio.gather(*self._closing, return_exceptions=True)
