"""Settings of the sidecar: defaults < TOML config file (``--config FILE``) < command-line flags."""
from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..core.transfer import Limits
from . import credentials
from .credentials import TOKEN_ENV


@dataclass
class SidecarConfig:
    name: str = "sidecar"
    api: str = "127.0.0.1:50151"              # local API for the inference server
    listen: str = "0.0.0.0:50152"             # where peers reach this sidecar (needs a peer credential,
                                              #   or --insecure, unless loopback: credentials.check_exposure)
    insecure: bool = False                    # accept unauthenticated peers on a network address
    peers: Dict[str, str] = field(default_factory=dict)   # name -> HOST:PORT
    allow_remote_api: bool = False            # let --api bind a non-loopback address
    allow_unknown_peers: bool = False         # accept links from senders not named by --peer
    local_shm: bool = True                    # local API: accept bytes handed over in /dev/shm (same host)
    peer_transport: str = "auto"              # "auto": a peer's TCP data plane when it offers one; "grpc": Link
    data_port: int = 0                        # this sidecar's TCP data plane port (0: any free; -1: none)
    metrics_port: int = 0                     # 0 = no metrics endpoint
    metrics_host: str = "127.0.0.1"
    # chunking and flow control
    chunk_size: int = 256 << 10
    ingest_readahead: int = 4 << 20           # normal/low flow transfers: unsent bytes buffered ahead of the link
    max_chunk_size: int = 4 << 20             # on a fast link chunks grow from chunk_size up to this (see chunk_bytes)
    whole_part_bytes: int = 1 << 20           # a part up to this size goes as one chunk (no short tails)
    min_cwnd: int = 0                         # bytes; 0: default_min_cwnd(chunk_size)
    quantum_normal: int = 3 << 20             # DRR quantum per turn, bytes
    quantum_low: int = 1 << 20
    max_wait_s: float = 0.5                   # aging: a normal/low chunk waits at most this long behind high
    # limits
    max_total_bytes: int = 2 << 30            # buffered bytes in total (outgoing + incoming)
    max_peer_bytes: int = 1 << 30             # buffered bytes per peer
    max_message_bytes: int = 8 << 20          # largest gRPC message accepted (a chunk and its header)
    admission_timeout_s: float = 10.0         # a sender over the cap waits this long, then RESOURCE_EXHAUSTED
    lease_s: float = 60.0                     # received transfers not collected in time are dropped
    stall_timeout_s: float = 30.0             # a transfer without progress this long fails
    resume_timeout_s: float = 30.0            # a peer gone this long: its transfers fail with UNAVAILABLE
    max_retransmits: int = 8                  # per chunk, then DATA_LOSS
    drain_s: float = 5.0                      # graceful shutdown: time to finish in-flight transfers
    max_open_transfers: int = 1024            # per peer: transfers held here (in progress or not collected)
    max_lease_s: float = 600.0                # the longest lease a sender may ask for (longer ones are cut)
    max_unknown_peers: int = 32               # unknown peers counted by name; the rest together as "other"
    max_connections: int = 256                # per port, at most (the descriptor limit may cap them lower)
    hello_timeout_s: float = 5.0              # a new connection must complete its handshake/hello in this
    idle_timeout_s: float = 300.0             # a connection without calls or frames this long is closed
    spool_dir: Optional[str] = None           # receiver: keep received chunks on disk, resume after a restart
    # security
    token: Optional[str] = None               # shared token required on peer links and sent to peers
    token_file: Optional[str] = None
    peer_secrets_file: Optional[str] = None   # TOML NAME = "SECRET": pairwise secrets that bind peer names
    api_token: Optional[str] = None           # token required on the local API (default: a random one,
    api_token_file: Optional[str] = None      #   published for this user only; see proto/runtime.py)
    no_api_token: bool = False                # the local API open to every local user (the old default)
    tls_cert: Optional[str] = None            # PEM certificate chain of this sidecar
    tls_key: Optional[str] = None             # PEM private key
    tls_ca: Optional[str] = None              # PEM CA: peers must present a certificate it signed (mutual TLS)
    tls_server_name: Optional[str] = None     # override the name checked in peers' certificates
    # discovery (docs/discovery.md): peers from etcd besides --peer
    discovery: Optional[str] = None           # etcd://HOST:PORT[,HOST:PORT]/PREFIX
    role: str = "both"                        # registered role: prefill, decode or both
    advertise: Optional[str] = None           # HOST:PORT registered for peers (default: --listen once bound)
    server_url: Optional[str] = None          # the inference server's URL, registered for routers
    discovery_ttl_s: int = 10                 # lease: a dead sidecar leaves the registry within this
    discovery_load_s: float = 1.0             # the registered load is sampled (and put if changed) this often
    max_discovered_peers: int = 128           # entries beyond this are ignored (and logged)
    log_level: str = "INFO"
    # filled by validate(), not settings
    peer_secrets: Dict[str, str] = field(default_factory=dict, metadata={"internal": True})
    warnings: List[str] = field(default_factory=list, metadata={"internal": True})

    # -------------------------------------------------------------- validation
    def validate(self, from_command_line=()) -> "SidecarConfig":
        api_host, _ = parse_hostport(self.api, what="--api")
        listen_host, _ = parse_hostport(self.listen, what="--listen")
        if not is_loopback(api_host) and not self.allow_remote_api:
            raise ValueError(f"--api {self.api} is not a loopback address; add --allow-remote-api to allow it")
        for peer, addr in self.peers.items():
            if not peer or "=" in peer:
                raise ValueError(f"bad peer name {peer!r}")
            parse_hostport(addr, what=f"peer {peer}")
        if not 4 << 10 <= self.chunk_size <= 4 << 20:
            raise ValueError("--chunk-size must be between 4KiB and 4MiB (256KiB..1MiB recommended)")
        if self.chunk_size + (64 << 10) > self.max_message_bytes:
            raise ValueError("--max-message-bytes must exceed --chunk-size by at least 64KiB")
        if self.max_chunk_size <= 0:
            raise ValueError("--max-chunk-size must be positive (at most --chunk-size: chunks keep that size)")
        if self.whole_part_bytes < 0:
            raise ValueError("--whole-part-bytes must be >= 0")
        # Whole parts never make a chunk the receiver's message limit refuses.
        self.whole_part_bytes = min(self.whole_part_bytes, self.max_message_bytes - (64 << 10))
        if self.max_peer_bytes <= 0 or self.max_total_bytes <= 0:
            raise ValueError("memory caps must be positive")
        for name in ("max_open_transfers", "max_connections", "hello_timeout_s", "idle_timeout_s", "lease_s",
                     "max_lease_s"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number")
        if self.max_unknown_peers < 0:
            raise ValueError("--max-unknown-peers must be >= 0")
        self.max_lease_s = max(self.max_lease_s, self.lease_s)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        self.warnings = credentials.resolve(self, from_command_line)
        self.warnings += credentials.check_exposure(self, is_loopback(listen_host))
        if self.no_api_token and not is_loopback(api_host):
            raise ValueError("--no-api-token with a non-loopback --api would open the local API to the network")
        if self.peer_transport not in ("auto", "grpc"):
            raise ValueError(f"--peer-transport must be 'auto' or 'grpc', got {self.peer_transport!r}")
        if not -1 <= self.data_port <= 65535:
            raise ValueError("--data-port must be a port, 0 (any free port) or -1 (no data plane)")
        if self.discovery:
            from ..discovery.settings import check_settings
            self.warnings += check_settings(self, listen_host, is_loopback(listen_host))
        return self

    def sender_settings(self) -> "SenderSettings":
        return SenderSettings(self.chunk_size, self.min_cwnd or default_min_cwnd(self.chunk_size),
                              self.quantum_normal, self.quantum_low, self.max_wait_s,
                              Limits(self.max_retransmits, self.stall_timeout_s, self.resume_timeout_s),
                              0.0 if self.min_cwnd else DEFAULT_MIN_CWND_S)


# The default floor is also at most this long of the measured path (CongestionController.floor): on a
# slow link 2 MiB is most of a second of queue in front of every high-priority chunk.
DEFAULT_MIN_CWND_S = 0.2


def default_min_cwnd(chunk_size: int) -> int:
    """--min-cwnd's default: two chunks, and at least 2 MiB. The BDP is computed from the minimum RTT, which
    a Python sidecar on a busy host sees in quiet moments only; its real round trips (scheduling, the peer's
    event loop) are far longer, and a window of a few chunks starves the path (docs/kvflow.md, Flow
    control). 2 MiB keeps the queue it can build below the sender short."""
    return max(2 * int(chunk_size), 2 << 20)


@dataclass(frozen=True)
class SenderSettings:
    """What a peer sender and its outbox take from the config."""
    chunk_size: int
    min_cwnd: int
    quantum_normal: int
    quantum_low: int
    max_wait_s: float
    limits: Limits
    min_cwnd_s: float = 0.0         # > 0: the floor at most this long of the measured path (default --min-cwnd)


_SIZE_FIELDS = {"chunk_size", "max_chunk_size", "ingest_readahead", "whole_part_bytes", "min_cwnd", "quantum_normal",
                "quantum_low", "max_total_bytes", "max_peer_bytes", "max_message_bytes"}
_FIELDS = {f.name: f for f in dataclasses.fields(SidecarConfig) if not f.metadata.get("internal")}
_KEYS = set(_FIELDS)


def _coerce(name: str, value):
    if name in _SIZE_FIELDS:
        return parse_size(value, what=name)
    if name == "peers":
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return dict(parse_peer(v) for v in value)
    default = _FIELDS[name].default
    if isinstance(default, bool):
        if isinstance(value, str):
            return value.lower() in ("1", "true", "yes", "on")
        return bool(value)
    if isinstance(default, int) and not isinstance(default, bool):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return None if value is None else str(value)


def parse_peer(text: str):
    name, sep, addr = str(text).partition("=")
    if not sep or not name or not addr:
        raise ValueError(f"--peer {text!r} must be NAME=HOST:PORT")
    return name.strip(), addr.strip()


def load_toml(path: str) -> dict:
    """Read a config file. Keys are the flag names (dashes or underscores); ``[peers]`` is a table of
    NAME = "HOST:PORT"; tables ``[limits]``, ``[tls]``, ``[auth]``, ``[flow]`` may group keys."""
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    out = {}
    for key, value in raw.items():
        k = key.replace("-", "_")
        if isinstance(value, dict) and k != "peers":
            for sub_key, sub_value in value.items():
                sk = sub_key.replace("-", "_")
                if sk not in _KEYS and f"{k}_{sk}" in _KEYS:
                    sk = f"{k}_{sk}"
                out[sk] = sub_value
        else:
            out[k] = value
    unknown = sorted(set(out) - _KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ciuicflow-sidecar",
        description="KV-flow sidecar: moves KV-cache data between inference servers with priorities and "
                    "congestion control. Flags override the --config file.",
    )
    S = argparse.SUPPRESS
    a = p.add_argument
    a("--config", metavar="FILE", help="TOML config file (keys as the flags, [peers] table)")
    a("--name", default=S, help="this sidecar's name (peers know it by this)")
    a("--api", default=S, metavar="HOST:PORT", help="local API for the inference server (default 127.0.0.1:50151)")
    a("--listen", default=S, metavar="HOST:PORT", help="where peers reach this sidecar (default 0.0.0.0:50152; "
                                                       "off loopback it needs a peer credential or --insecure)")
    a("--peer", dest="peers", action="append", default=S, metavar="NAME=HOST:PORT", help="a peer (repeatable)")
    a("--allow-remote-api", action="store_true", default=S, help="allow --api on a non-loopback address")
    a("--allow-unknown-peers", action="store_true", default=S, help="accept links from senders not named by --peer")
    a("--insecure", action="store_true", default=S,
      help="let a --listen address reachable from the network go without a peer credential (--token-file, "
           "--peer-secrets-file, --tls-ca): any client could send as a peer (not recommended)")
    a("--no-local-shm", dest="local_shm", action="store_false", default=S,
      help="local API: refuse shared-memory handoff (clients then send bytes in-band)")
    a("--peer-transport", default=S, choices=("auto", "grpc"),
      help="how chunks go to peers: 'auto' (default) uses a peer's TCP data plane when it offers one (not "
           "with TLS), else the gRPC Link stream; 'grpc' always uses the gRPC stream")
    a("--data-port", type=int, default=S, help="port of this sidecar's TCP data plane, on the --listen host "
                                                "(default 0: any free port; -1: none, peers use gRPC)")
    a("--metrics-port", type=int, default=S, help="Prometheus metrics port (0: off)")
    a("--metrics-host", default=S, help="metrics address (default 127.0.0.1)")
    a("--chunk-size", default=S, help="chunk size on a slow link, e.g. 256KiB (256KiB..1MiB recommended)")
    a("--max-chunk-size", default=S, help="on a fast link chunks grow from --chunk-size (doubling) to what the "
                                        "link carries in 20 ms, up to this (default 4MiB; at most "
                                        "--chunk-size: chunks keep that size)")
    a("--ingest-readahead", default=S, help="normal/low flow transfers: read at most this many unsent bytes "
                                          "ahead from the local client (default 4MiB; 0: no limit)")
    a("--whole-part-bytes", default=S, help="a part (layer) up to this size (or up to the link's chunk size) "
                                          "goes as one chunk instead of being cut (default 1MiB; "
                                          "0: --chunk-size)")
    a("--min-cwnd", default=S, help="smallest congestion window in bytes (default max(2 chunks, 2MiB))")
    a("--quantum-normal", default=S, help="DRR quantum of class normal per turn (default 3MiB)")
    a("--quantum-low", default=S, help="DRR quantum of class low per turn (default 1MiB)")
    a("--max-wait-s", type=float, default=S, help="aging: longest wait of normal/low behind high (default 0.5)")
    a("--max-total-bytes", default=S, help="cap on buffered bytes in total (default 2GiB)")
    a("--max-peer-bytes", default=S, help="cap on buffered bytes per peer (default 1GiB)")
    a("--max-message-bytes", default=S, help="largest gRPC message accepted (default 8MiB)")
    a("--admission-timeout-s", type=float, default=S, help="wait over the cap before RESOURCE_EXHAUSTED (10)")
    a("--lease-s", type=float, default=S, help="uncollected received transfers expire after this (60)")
    a("--stall-timeout-s", type=float, default=S, help="a transfer without progress fails after this (30)")
    a("--resume-timeout-s", type=float, default=S, help="a peer gone this long fails its transfers (30)")
    a("--max-retransmits", type=int, default=S, help="retransmits of one chunk before DATA_LOSS (8)")
    a("--drain-s", type=float, default=S, help="graceful shutdown: time to finish in-flight transfers (5)")
    a("--max-open-transfers", type=int, default=S, help="per peer: transfers held (in progress or not yet "
                                                        "collected); more are refused (1024)")
    a("--max-lease-s", type=float, default=S, help="longest lease a sender may ask for (600; at least --lease-s)")
    a("--max-unknown-peers", type=int, default=S, help="--allow-unknown-peers: names counted apart in metrics "
                                                       "and memory caps; the rest share 'other' (32)")
    a("--max-connections", type=int, default=S, help="connections per port at most: local API, peer port, "
                                                     "data plane, metrics, descriptor socket (256; the "
                                                     "descriptor limit may cap them lower: logged at start)")
    a("--hello-timeout-s", type=float, default=S, help="a connection must complete its handshake in this (5)")
    a("--idle-timeout-s", type=float, default=S, help="a connection without calls or frames this long is "
                                                      "closed (300)")
    a("--spool-dir", default=S, metavar="DIR", help="keep received chunks on disk to resume after a restart")
    a("--token", default=S, help=f"shared peer token (or --token-file, or ${TOKEN_ENV})")
    a("--token-file", default=S, metavar="FILE")
    a("--peer-secrets-file", default=S, metavar="FILE",
      help='TOML table NAME = "SECRET": the secret shared with each peer; binds peer names to credentials')
    a("--api-token", default=S, help="token required on the local API (prefer --api-token-file)")
    a("--api-token-file", default=S, metavar="FILE",
      help="file holding the local API's token (default: a random token, published for this user only)")
    a("--no-api-token", action="store_true", default=S,
      help="local API without a token: open to every local user (loopback only; not recommended)")
    a("--tls-cert", default=S, metavar="PEM", help="certificate chain for peer links")
    a("--tls-key", default=S, metavar="PEM", help="private key for peer links")
    a("--tls-ca", default=S, metavar="PEM", help="CA that signs peers' certificates: turns on mutual TLS")
    a("--tls-server-name", default=S, help="name expected in peers' certificates (default: the peer's host)")
    d = p.add_argument_group("discovery", "peers found through etcd besides --peer (docs/discovery.md)")
    d.add_argument("--discovery", default=S, metavar="etcd://HOST:PORT[,HOST:PORT]/PREFIX",
                   help="register here under a lease and watch the others: new peers are connected once they "
                        "prove their name (pairwise secret or certificate), vanished ones dropped")
    d.add_argument("--role", default=S, choices=("prefill", "decode", "both"), help="registered role (both)")
    d.add_argument("--advertise", default=S, metavar="HOST:PORT",
                   help="peer address to register (default: --listen as bound; needed with a wildcard --listen)")
    d.add_argument("--server-url", default=S, metavar="URL",
                   help="URL of the inference server beside this sidecar, registered for routers (the proxy)")
    d.add_argument("--discovery-ttl-s", type=int, default=S,
                   help="lease TTL: a dead sidecar leaves every peer within this (10; etcd's minimum ~2)")
    d.add_argument("--discovery-load-s", type=float, default=S,
                   help="how often the registered load is sampled, and put again if changed (1.0)")
    d.add_argument("--max-discovered-peers", type=int, default=S,
                   help="discovered peers at most; further entries are ignored and logged (128)")
    a("--log-level", default=S, help="DEBUG, INFO, WARNING (default INFO)")
    return p


def parse_command_line(argv: Optional[List[str]] = None) -> SidecarConfig:
    """The settings of a command line (faults are no settings: ciuicflow.testing.kvflow_faults)."""
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config", None)
    values = load_toml(config_file) if config_file else {}
    file_peers = _coerce("peers", values.pop("peers", {}))
    flag_peers = _coerce("peers", args.pop("peers", []))
    values.update(args)
    cfg = SidecarConfig()
    for key, value in values.items():
        setattr(cfg, key, _coerce(key, value))
    cfg.peers = {**file_peers, **flag_peers}
    return cfg.validate(from_command_line=set(args))


def load_config(argv: Optional[List[str]] = None) -> SidecarConfig:
    """The settings of a command line."""
    return parse_command_line(argv)


# ---------------------------------------------------------------------- sizes and addresses
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b|bit|bits|byte|bytes)?\s*$", re.I)


def parse_size(value, *, what: str = "size") -> int:
    """'256KiB', '1MiB', '1.5G', '100Mbit' (bits: divided by 8), 4096 -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{what} must not be negative")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"cannot read {what} {value!r} (examples: 262144, 256KiB, 1MiB, 100Mbit)")
    number, prefix, binary, unit = m.groups()
    base = 1024 if binary else 1000
    mult = {"": 1, "k": base, "m": base ** 2, "g": base ** 3, "t": base ** 4}[prefix.lower()]
    n = float(number) * mult
    if unit and unit.lower().startswith("bit"):
        n /= 8
    return int(n)


def parse_hostport(value: str, *, what: str = "address") -> Tuple[str, int]:
    value = str(value).strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_s = rest.lstrip(":")
    else:
        host, sep, port_s = value.rpartition(":")
        if not sep:
            raise ValueError(f"{what} {value!r} must be HOST:PORT")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"{what} {value!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{what} {value!r}: port out of range")
    return host or "0.0.0.0", port


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")

