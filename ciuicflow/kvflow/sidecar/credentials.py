"""The sidecar's secrets, read once at start-up: the shared peer token, the pairwise peer secrets and the
local API token. From files or the environment (a flag's value is visible to every local user in
``/proc/PID/cmdline``); an empty token or secret is refused, never taken to mean "no authentication"."""
from __future__ import annotations

import logging
import os
import secrets
import tomllib
from typing import Dict, List, Optional

from ..core.identity import check_peer_name
from ..proto.runtime import API_TOKEN_ENV, read_secret

log = logging.getLogger("ciuicflow.kvflow")

TOKEN_ENV = "CIUICFLOW_KVFLOW_TOKEN"


def _check_file_mode(path: str, what: str, warnings: List[str]) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & 0o077:
        warnings.append(f"{what} file {path} is readable by other users (mode {mode & 0o777:o}); chmod 600 it")


def _env(name: str) -> Optional[str]:
    value = os.environ.get(name)
    if value is not None and not value.strip():
        raise ValueError(f"${name} is set but empty: unset it, or give a token")
    return value.strip() if value is not None else None


def resolve_token(flag: Optional[str], path: Optional[str], env: str, what: str,
                  warnings: List[str]) -> Optional[str]:
    """A token from its flag, else its file, else the environment (None: not configured)."""
    if flag is not None:
        if not flag.strip():
            raise ValueError(f"{what} is empty")
        return flag.strip()
    if path:
        _check_file_mode(path, what, warnings)
        return read_secret(path, what)
    return _env(env)


def load_peer_secrets(path: str, warnings: List[str]) -> Dict[str, str]:
    """``--peer-secrets-file``: a TOML table ``NAME = "SECRET"``, the secret this sidecar shares with each peer
    (both ends of a pair hold the same one)."""
    _check_file_mode(path, "--peer-secrets-file", warnings)
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    out = {}
    for name, secret in raw.items():
        err = check_peer_name(name)
        if err:
            raise ValueError(f"{path}: {err}: {name!r}")
        if not isinstance(secret, str) or not secret.strip():
            raise ValueError(f"{path}: the secret of peer {name!r} is empty or not a string")
        out[name] = secret.strip()
    if not out:
        raise ValueError(f"{path}: no peer secrets in it")
    return out


def resolve(cfg, from_command_line=()) -> List[str]:
    """Fill ``cfg.token``, ``cfg.api_token`` and ``cfg.peer_secrets``; the warnings to log once logging is
    set up. ``from_command_line``: the settings given as flags (their values are visible to other users)."""
    warnings: List[str] = []
    for name in ("token", "api_token"):
        if name in from_command_line:
            flag = "--" + name.replace("_", "-")
            warnings.append(f"{flag} on the command line is visible to every local user in /proc/PID/cmdline; "
                            f"use {flag}-file or ${TOKEN_ENV if name == 'token' else API_TOKEN_ENV}")
    cfg.token = resolve_token(cfg.token, cfg.token_file, TOKEN_ENV, "--token", warnings)
    cfg.api_token = resolve_token(cfg.api_token, cfg.api_token_file, API_TOKEN_ENV, "--api-token", warnings)
    cfg.peer_secrets = load_peer_secrets(cfg.peer_secrets_file, warnings) if cfg.peer_secrets_file else {}
    if cfg.no_api_token and cfg.api_token:
        raise ValueError("--no-api-token contradicts an API token (--api-token, --api-token-file or "
                         f"${API_TOKEN_ENV})")
    if cfg.token and not cfg.peer_secrets and not cfg.tls_ca and len(cfg.peers) > 1:
        warnings.append("peer names are bound to no credential (only the shared --token): any holder of the "
                        "token can claim any peer's name; use --peer-secrets-file or mutual TLS (--tls-ca)")
    return warnings


def check_exposure(cfg, loopback: bool) -> List[str]:
    """Safe by default: a sidecar whose peer port (``--listen``) is reachable from the network must
    authenticate its peers (a shared token, per-peer secrets or mutual TLS), unless ``--insecure`` says
    the operator means it; raises ValueError (what to add) otherwise. A loopback-only sidecar may go without
    (tests, one host), with a warning. Sets ``cfg.insecure`` to whether peers are unauthenticated by
    the operator's choice; the warnings to log."""
    if cfg.token or cfg.peer_secrets or cfg.tls_ca:
        note = ["--insecure has no effect: peer credentials are configured"] if cfg.insecure else []
        cfg.insecure = False
        return note
    if loopback:
        cfg.insecure = False
        return [f"no peer credential: any local process that reaches --listen {cfg.listen} can send as any "
                f"configured peer (loopback only: fine for tests and one host); add --token-file FILE, "
                f"--peer-secrets-file FILE or mutual TLS (--tls-cert/--tls-key/--tls-ca) to authenticate peers"]
    if not cfg.insecure:
        raise ValueError(
            f"--listen {cfg.listen} is reachable from the network, but no peer credential is configured, so any "
            f"client could send as a configured peer. Add one: --token-file FILE (or ${TOKEN_ENV}), "
            f"--peer-secrets-file FILE, or mutual TLS (--tls-cert PEM --tls-key PEM --tls-ca PEM); or listen on "
            f"loopback only (--listen 127.0.0.1:PORT); or, to accept unauthenticated peers anyway (not "
            f"recommended), add --insecure")
    return ["!!! INSECURE (--insecure): peers are NOT authenticated on --listen "
            f"{cfg.listen}: anyone who reaches it can send and take transfers as any configured peer; add "
            "--token-file, --peer-secrets-file or mutual TLS (--tls-ca) !!!"]


def new_api_token() -> str:
    """The local API's token when none is configured: random, published for this user only."""
    return secrets.token_urlsafe(32)
