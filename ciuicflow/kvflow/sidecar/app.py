"""The KV-flow sidecar: ``Sidecar`` and the process's life (``run``); ``ciuicflow.kvflow.server.main`` is its
command line (``ciuicflow-sidecar``, ``python -m ciuicflow.kvflow.server`` or ``.sidecar``).

Two gRPC servers on one asyncio event loop:
  * the local API (``KVFlow``: Send, Recv, Stats, ShmProbe) on ``--api`` (loopback unless ``--allow-remote-api``);
  * the peer port (``KVFlowPeer``: Link, DataPlane) on ``--listen``, with optional mutual TLS and a shared
    token, beside the TCP data plane (``--data-port``).
Both also serve gRPC health checking and reflection. Prometheus metrics on ``--metrics-port``.

``Sidecar`` builds the parts, each given only what it uses: the local API (``LocalApi``) hands a Send to
``Ingest``, which fills the destination's ``PeerSender`` outbox; the sender streams it over a transport to the
peer's ``PeerService``, which fills the ``Store`` that Recv delivers from.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from typing import Callable, List, Optional

import grpc

from ..core.budget import MemoryBudget
from ..core.identity import PeerPolicy
from ..core.descriptors import descriptor_caps, descriptor_limit
from ..core.limits import Labels
from ..proto import kvflow_pb2 as pb
from ..proto import kvflow_pb2_grpc as pb_grpc
from ..proto.codec import safe_deserializer
from ..proto import runtime
from ..proto import shm as shmlib
from ..proto.messages import LOCAL_SERVICE, PEER_SERVICE
from ..transports.base import Transport
from ..transports.tcp_server import DataPlaneServer
from . import grpc_setup
from .config import SidecarConfig, format_hostport, parse_hostport
from .credentials import new_api_token
from .fd_handoff import FdRegistry, HandoffServer
from .ingest import Ingest
from .local_api import LocalApi
from .metrics import Metrics
from .peer_service import PeerService
from .peers import Peers
from .shm_access import ShmAccess
from .store import Store

log = logging.getLogger("ciuicflow.kvflow")

ABORT_FLUSH_S = 5.0     # on shutdown, how long a sender may take to deliver its last frames (the aborts)
MESSAGE_SLACK = 64 << 10  # a chunk's frame: its data plus at most this much header
METRICS_IDLE_S = 30.0     # a metrics client that does not take its response within this is dropped


class Sidecar:
    """One sidecar. ``wrap_transport(transport) -> transport`` and ``inbound_throttle(nbytes)`` (awaitable)
    are the fault seams: tests and benchmarks inject faults there (ciuicflow.testing.kvflow_faults)."""

    def __init__(self, cfg: SidecarConfig, *, wrap_transport: Optional[Callable[[Transport], Transport]] = None,
                 inbound_throttle=None):
        self.cfg = cfg
        self.wrap_transport = wrap_transport
        self.shutting_down = False
        self.started = time.monotonic()
        self.metrics = Metrics()
        self.budget = MemoryBudget(cfg.max_total_bytes, cfg.max_peer_bytes, on_change=self._budget_changed)
        self.labels = Labels(cfg.peers, cfg.max_unknown_peers)     # peer names in metrics and budget accounts
        self.store = Store(self.budget, self.metrics, cfg.lease_s, cfg.resume_timeout_s, self.labels)
        known = set(cfg.peers)          # Peers adds and removes discovered names
        # With discovery a peer may link here before this sidecar has read its entry: its credential, which
        # binds its name (secret, certificate), is what admits it (docs/discovery.md, Trust).
        self.policy = PeerPolicy(cfg.token, cfg.peer_secrets, bool(cfg.tls_ca), known,
                                 cfg.allow_unknown_peers or bool(cfg.discovery))
        self.peer_service = PeerService(self.store, self.budget, self.metrics, policy=self.policy,
                                        shutting_down=self._is_shutting_down, throttle=inbound_throttle,
                                        labels=self.labels, max_open_transfers=cfg.max_open_transfers,
                                        max_lease_s=cfg.max_lease_s)
        self.peers = Peers(cfg, self.policy, self.budget, self.metrics, known, self.labels, wrap_transport)
        self.discovery = None           # discovery.service.Discovery, with --discovery
        # Shared memory: only the caller's own files (descriptors handed over, or named files with their
        # secret); the descriptor socket starts with the local API (start).
        # Every port's connections and the ring handles hold descriptors: their caps share out the
        # descriptor limit (core/descriptors.py), so no flood reaches it.
        self.caps = descriptor_caps(descriptor_limit(), cfg.max_connections,
                                    len(cfg.peers) + (cfg.max_discovered_peers if cfg.discovery else 0))
        self.fd_registry = FdRegistry(self.caps.handles, self.caps.handles_per_client)
        self.shm_access = ShmAccess(shmlib.shm_dir(), self.fd_registry) if cfg.local_shm else None
        self.handoff: Optional[HandoffServer] = None
        self.ingest = Ingest(self.budget, chunk_size=cfg.chunk_size, whole_part_bytes=cfg.whole_part_bytes,
                             chunk_limit=min(cfg.max_chunk_size, cfg.max_message_bytes - MESSAGE_SLACK),
                             readahead=cfg.ingest_readahead, admission_timeout_s=cfg.admission_timeout_s,
                             local_shm=cfg.local_shm, access=self.shm_access)
        # The local API always needs a token unless --no-api-token: a random one when none is configured,
        # published (start) where only this user's processes can read it (proto/runtime.py).
        self.api_token = None if cfg.no_api_token else (cfg.api_token or new_api_token())
        self.api_token_path: Optional[str] = None
        self.local_api = LocalApi(self.peers.sender, self.ingest, self.store, self.metrics, api_token=self.api_token,
                                  local_shm=cfg.local_shm, shutting_down=self._is_shutting_down, stats=self.stats,
                                  max_lease_s=cfg.max_lease_s, access=self.shm_access,
                                  refusal=self.peers.refusal)
        self.servers = grpc_setup.Servers(cfg.max_message_bytes)
        self.data_plane: Optional[DataPlaneServer] = None
        self.api_address = ""
        self.listen_address = ""
        self.metrics_address = ""
        self.metrics_server = None
        self._tasks: List[asyncio.Task] = []

    def _is_shutting_down(self) -> bool:
        return self.shutting_down

    def _budget_changed(self, peer: str, peer_used: int, total: int) -> None:
        self.metrics.buffered.labels(peer).set(peer_used)
        self.metrics.buffered_total.set(total)

    def _rejected(self, code: grpc.StatusCode) -> None:
        self.metrics.rejected.labels(code.name).inc()

    # ------------------------------------------------------------------ start / stop
    async def start(self) -> None:
        cfg, caps = self.cfg, self.caps
        log.info("%s", caps.describe())
        limits = grpc_setup.ServerLimits(caps.api, cfg.hello_timeout_s, cfg.idle_timeout_s)
        # Small HTTP/2 windows on the local API: the memory cap, not gRPC, is the buffer.
        api_server = self.servers.new(LOCAL_SERVICE, self.local_api, pb_grpc.add_KVFlowServicer_to_server,
                                      [("grpc.http2.bdp_probe", 0)], limits)
        api_host, api_port = parse_hostport(cfg.api)
        bound = api_server.add_insecure_port(format_hostport(api_host, api_port))
        if bound == 0:
            raise RuntimeError(f"cannot bind the local API on {cfg.api}")
        self.api_address = format_hostport(api_host, bound)
        self._publish_api_token(bound)
        self._start_handoff(bound)

        # A peer needs one connection and a few streams; strangers get no more before they authenticate.
        peer_limits = dataclasses.replace(limits, max_connections=caps.peer, streams_per_connection=32,
                                          max_rpcs=4 * caps.peer)
        peer_server = self.servers.new(PEER_SERVICE, self.peer_service, pb_grpc.add_KVFlowPeerServicer_to_server,
                                       limits=peer_limits)
        host, port = parse_hostport(cfg.listen)
        listen = format_hostport(host, port)
        creds = grpc_setup.server_credentials(cfg)
        bound = peer_server.add_secure_port(listen, creds) if creds else peer_server.add_insecure_port(listen)
        if bound == 0:
            raise RuntimeError(f"cannot bind the peer port on {cfg.listen}")
        self.listen_address = format_hostport(host, bound)
        if cfg.data_port >= 0 and not cfg.tls_cert:     # no TLS on the data plane: TLS peers keep to gRPC
            self.data_plane = DataPlaneServer(self.peer_service.serve, safe_deserializer(pb.PeerFrame.FromString),
                                              cfg.max_message_bytes, self._rejected,
                                              max_connections=caps.data,
                                              max_unauthenticated=max(1, min(32, caps.data // 2)),
                                              hello_timeout_s=cfg.hello_timeout_s, idle_timeout_s=cfg.idle_timeout_s)
            await self.data_plane.start(host, cfg.data_port)
            self.peer_service.use_data_plane(self.data_plane)

        if cfg.spool_dir:
            from .spool import Spool
            from .spool_restore import restore
            try:
                spool = Spool(cfg.spool_dir)
            except OSError as exc:
                raise RuntimeError(f"cannot use --spool-dir: {exc}") from None
            restored = restore(spool, self.budget, self.store)
            self.store.use_spool(spool)
            if restored:
                log.info("restored %d transfer(s) from spool %s", restored, cfg.spool_dir)

        await self.servers.start()
        if cfg.metrics_port:
            self.metrics_server = self.metrics.serve(cfg.metrics_port, cfg.metrics_host,
                                                     max_connections=caps.metrics,
                                                     header_timeout_s=cfg.hello_timeout_s,
                                                     idle_timeout_s=min(cfg.idle_timeout_s, METRICS_IDLE_S))
            self.metrics_address = format_hostport(cfg.metrics_host, cfg.metrics_port)
        self.metrics.insecure.set(1 if cfg.insecure else 0)
        self.metrics.export_load(self.load)
        for name, address in cfg.peers.items():
            self.peers.add(name, address)
        self._tasks.append(asyncio.create_task(self._sweeper()))
        if cfg.discovery:
            from ..discovery.service import Discovery
            self.discovery = Discovery(cfg, self.peers, self.listen_address, self.load,
                                       lambda address, name: grpc_setup.peer_channel(cfg, address, name))
            self.peer_service.use_identity(self.discovery.identity)
            self.discovery.start()

    def _publish_api_token(self, port: int) -> None:
        """Put the local API's token where this user's clients find it (and no other user can read it)."""
        if self.api_token is None:
            log.warning("local API without a token (--no-api-token): every local user may send and receive")
            return
        try:
            self.api_token_path = runtime.api_file(port, "token", create_dir=True)
            if not self.cfg.api_token:
                # The token a sidecar on this port published before stays: clients that read it keep working
                # across a restart (delete the file to change it).
                try:
                    self.api_token = runtime.read_secret(self.api_token_path, "token")
                except (OSError, ValueError):
                    pass
            runtime.publish(self.api_token_path, self.api_token)
            self.local_api.use_token(self.api_token, f"; this sidecar's user finds it in {self.api_token_path}")
        except OSError as exc:       # PermissionError too: a runtime directory that is not private
            self.api_token_path = None
            if not self.cfg.api_token:
                raise RuntimeError(f"cannot publish the local API token: {exc}; give one with --api-token-file "
                                   f"or ${runtime.API_TOKEN_ENV}") from None
            log.warning("local API token not published (%s): clients must be given it", exc)

    def _start_handoff(self, port: int) -> None:
        """The Unix socket clients of this user hand their rings' descriptors over on (fd_handoff.py)."""
        if self.shm_access is None:
            return
        try:
            self.handoff = HandoffServer(self.fd_registry, runtime.api_file(port, "sock", create_dir=True),
                                         self.caps.handoff)
            self.handoff.start()
        except OSError as exc:
            self.handoff = None
            log.warning("no descriptor socket for shared memory (%s): clients use named files", exc)

    async def _sweeper(self) -> None:
        period = max(0.05, min(1.0, self.cfg.lease_s / 4))
        while True:
            await asyncio.sleep(period)
            try:
                self.store.sweep()
            except Exception:   # noqa: BLE001 - keep serving
                log.exception("sweep failed")

    async def stop(self) -> None:
        """Graceful shutdown: refuse new work, let in-flight transfers finish for ``drain_s``, then fail the
        rest explicitly (UNAVAILABLE to local senders and to receivers)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: draining for up to %gs", self.cfg.drain_s)
        if self.discovery is not None:
            await self.discovery.stop()         # peers drop this sidecar now, not after the lease TTL
        await self.servers.not_serving()
        senders = self.peers.all()
        if self.cfg.drain_s > 0:
            try:
                await asyncio.wait_for(asyncio.gather(*(s.drained() for s in senders)), self.cfg.drain_s)
            except asyncio.TimeoutError:
                pass
        for sender in senders:
            sender.fail_all(grpc.StatusCode.UNAVAILABLE, "sending sidecar is shutting down")
        # The aborts must reach the receivers, behind whatever data is still in the streams.
        await self.peers.close(ABORT_FLUSH_S)
        self.store.notify_all()       # Recv streams see shutting_down
        for task in self._tasks:
            task.cancel()
        if self.data_plane is not None:
            await self.data_plane.stop()
        await self.servers.stop(1.0)
        if self.handoff is not None:
            self.handoff.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.shm_access is not None:
            self.shm_access.close()
        log.info("stopped")

    def stats(self) -> dict:
        return {
            "name": self.cfg.name,
            "uptime_s": time.monotonic() - self.started,
            "api": self.api_address,
            "listen": self.listen_address,
            "data_port": self.data_plane.port if self.data_plane else None,
            "chunk_size": self.cfg.chunk_size,
            "memory": self.budget.snapshot(),
            "peers": {sender.name: sender.snapshot() for sender in self.peers.all()},
            "store": self.store.snapshot(),
            "shutting_down": self.shutting_down,
            "insecure": self.cfg.insecure,
            "caps": dataclasses.asdict(self.caps),
            "load": self.load().as_dict(),
            **({"discovery": self.discovery.snapshot()} if self.discovery is not None else {}),
        }

    def load(self):
        """The load this sidecar reports (Stats, and its registry entry for routers): bytes buffered in it,
        transfers in flight both ways, and its fastest link's bandwidth estimate (bytes/s)."""
        from ..discovery.entry import Load
        senders = self.peers.all()
        outgoing = sum(s.in_progress() for s in senders)
        link = max((s.link_bandwidth() for s in senders), default=0.0)
        return Load(int(self.budget.used), self.store.incoming() + outgoing, float(link))


async def serve(cfg: SidecarConfig, ready=None, **faults) -> None:
    """Run a sidecar until SIGTERM or SIGINT; ``faults``: Sidecar's fault seams."""
    sidecar = Sidecar(cfg, **faults)
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    peers = ",".join(f"{n}={a}" for n, a in cfg.peers.items()) or "-"
    log.info("sidecar %r ready: api=%s listen=%s metrics=%s peers=%s tls=%s token=%s data-plane=%s "
             "peer-secrets=%s api-token=%s discovery=%s", cfg.name,
             sidecar.api_address, sidecar.listen_address, sidecar.metrics_address or "-", peers,
             "mutual" if cfg.tls_ca else ("on" if cfg.tls_cert else "off"), "on" if cfg.token else "off",
             f"tcp:{sidecar.data_plane.port}" if sidecar.data_plane else "off",
             len(cfg.peer_secrets) or "off", sidecar.api_token_path or ("on" if sidecar.api_token else "OFF"),
             cfg.discovery or "off")
    if ready is not None:
        ready(sidecar)
    await stop.wait()
    await sidecar.stop()


def tune_malloc() -> bool:
    """Keep freed chunk buffers in the heap instead of giving them back to the OS at once.

    Every chunk is a fresh buffer of up to a few MiB; with glibc's defaults each is a new mmap (or a heap top
    that is trimmed again), so every chunk pays page faults for each copy into it (docs/kvflow.md, Memory
    allocator). Large buffers then come from the heap and are reused; the memory caps (--max-total-bytes)
    still bound what is held. ``CIUICFLOW_KVFLOW_MALLOC_TUNE=0`` turns this off."""
    if os.environ.get("CIUICFLOW_KVFLOW_MALLOC_TUNE", "1") == "0":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
        ok = libc.mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 and ok
        return ok
    except (OSError, AttributeError):
        return False


def run(cfg: SidecarConfig, **faults) -> int:
    """The sidecar process's life: logging, allocator and collector settings, then ``serve`` until a signal.
    ``faults``: Sidecar's fault seams (tests and benchmarks)."""
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if faults:
        log.warning("test faults injected: %s", ", ".join(sorted(faults)))
    for warning in cfg.warnings:
        log.warning("%s", warning)
    tune_malloc()
    # Every chunk allocates a few dozen short-lived objects (messages, futures, callbacks), which triggered a
    # young-generation collection every few chunks. They die young without cycles, so collect far less
    # often; startup's objects are frozen out of the scans.
    gc.set_threshold(50_000, 20, 20)
    try:
        asyncio.run(serve(cfg, ready=lambda _: gc.freeze(), **faults))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0
