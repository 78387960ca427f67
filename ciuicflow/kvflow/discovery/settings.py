"""--discovery's settings checked (sidecar/config.py calls this from SidecarConfig.validate)."""
from __future__ import annotations

from typing import List

from .entry import ROLES, URL_RE, EntryError, check_address
from .etcd import parse_target


def check_settings(cfg, listen_host: str, loopback: bool) -> List[str]:
    """--discovery's settings; the warnings. A registry entry grants no trust, so off loopback the peers'
    names must be bound to credentials (pairwise secrets or mutual TLS) unless --insecure."""
    parse_target(cfg.discovery)
    if cfg.role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}")
    if cfg.advertise:
        try:
            check_address(cfg.advertise, "--advertise")
        except EntryError as exc:
            raise ValueError(str(exc)) from None
    elif listen_host in ("0.0.0.0", "::"):
        raise ValueError(f"--discovery with --listen {cfg.listen}: give --advertise HOST:PORT, the address "
                         f"peers reach this sidecar at")
    if cfg.server_url and not URL_RE.match(cfg.server_url):
        raise ValueError("--server-url must be an http(s) URL")
    if not 2 <= cfg.discovery_ttl_s <= 3600:
        raise ValueError("--discovery-ttl-s must be between 2 and 3600 (etcd's smallest lease is about 2 s)")
    if not 0 < cfg.discovery_load_s <= 3600:
        raise ValueError("--discovery-load-s must be a positive number of seconds")
    if not 1 <= cfg.max_discovered_peers <= 4096:
        raise ValueError("--max-discovered-peers must be between 1 and 4096")
    if cfg.peer_secrets or cfg.tls_ca:
        return []
    if not loopback and not cfg.insecure:
        raise ValueError("--discovery: registry entries grant no trust, so peers must prove their names: add "
                         "--peer-secrets-file FILE or mutual TLS (--tls-cert/--tls-key/--tls-ca)")
    return ["--discovery without --peer-secrets-file or mutual TLS: a registry entry's name is checked against "
            "nothing, so whoever can write to etcd can pose as any peer (loopback/--insecure only)"]
