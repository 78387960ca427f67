"""A registry entry: what one sidecar publishes about itself (name, role, addresses, load), and the checks
every entry read back goes through. Pure: no I/O.

Whoever can write to etcd can write anything under the prefix, so a value read back is hostile: its size
is bounded before it is parsed, every field's type, length and range is checked, addresses must be
HOST:PORT, and the name in the key must be the name in the value. An entry that fails is dropped with the
reason (``EntryError``). An entry that passes still grants no trust: the peer must prove the name
(identify.py) before a sidecar sends to it or accepts it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Dict, Optional

from ..core.identity import check_peer_name

MAX_VALUE_BYTES = 4096          # one entry's JSON; a real one is a few hundred bytes
ROLES = ("prefill", "decode", "both")
LOAD_FIELDS = ("queued_bytes", "transfers", "link_bps")
MAX_LOAD = 1 << 62              # larger load figures are nonsense (and would overflow a router's sums)
_HOST_RE = re.compile(r"^[A-Za-z0-9.-]{1,253}$|^[0-9A-Fa-f:.]{2,45}$")
URL_RE = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]{1,300}(/[A-Za-z0-9._~/-]{0,200})?$")


class EntryError(ValueError):
    """Why a registry value was not taken."""


@dataclass(frozen=True)
class Load:
    """The load a sidecar reports: bytes queued in it (outgoing and held incoming), transfers in flight
    (sending and receiving), and its links' bandwidth estimate in bytes/s (0: not measured yet)."""
    queued_bytes: int = 0
    transfers: int = 0
    link_bps: float = 0.0

    def as_dict(self) -> dict:
        return {"queued_bytes": self.queued_bytes, "transfers": self.transfers, "link_bps": round(self.link_bps)}


@dataclass(frozen=True)
class Entry:
    name: str
    role: str
    peer: str                           # HOST:PORT of its peer port (--listen, or --advertise)
    server: str = ""                    # URL of the inference server it serves ("" : none), for routers
    load: Load = field(default_factory=Load)

    def encode(self) -> bytes:
        value = {"v": 1, "name": self.name, "role": self.role, "addresses": {"peer": self.peer},
                 "load": self.load.as_dict()}
        if self.server:
            value["addresses"]["server"] = self.server
        data = json.dumps(value, separators=(",", ":")).encode()
        if len(data) > MAX_VALUE_BYTES:
            raise EntryError(f"entry of {self.name!r} is {len(data)} bytes (at most {MAX_VALUE_BYTES})")
        return data

    def same_endpoint(self, other: "Entry") -> bool:
        """Whether a sender to ``other`` can go on as it is (only the load changed)."""
        return (self.name, self.peer) == (other.name, other.peer)


def check_address(value, what: str) -> str:
    """``HOST:PORT`` ([V6]:PORT too) with a plausible host and a port 1-65535; raises EntryError."""
    if not isinstance(value, str) or not 3 <= len(value) <= 300:
        raise EntryError(f"{what} must be a HOST:PORT string")
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = value.rpartition(":")
    if not host or not _HOST_RE.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise EntryError(f"{what} {value[:80]!r} is not HOST:PORT")
    if host in ("0.0.0.0", "::"):
        raise EntryError(f"{what} {value!r}: a wildcard address cannot be reached")
    return value


def _count(value, what: str, integer: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EntryError(f"load.{what} must be a number")
    if not math.isfinite(value) or not 0 <= value <= MAX_LOAD:
        raise EntryError(f"load.{what} out of range")
    return int(value) if integer else float(value)


def decode(key_name: str, data: bytes) -> Entry:
    """The entry stored under ``PREFIX/key_name``; raises EntryError for anything off."""
    if len(data) > MAX_VALUE_BYTES:
        raise EntryError(f"value of {len(data)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise EntryError("value is not UTF-8 JSON") from None
    if not isinstance(value, dict) or value.get("v") != 1:
        raise EntryError("value is not a version-1 entry object")
    name = value.get("name")
    if not isinstance(name, str) or check_peer_name(name):
        raise EntryError(f"bad name: {check_peer_name(name) if isinstance(name, str) else 'not a string'}")
    if name != key_name:
        raise EntryError(f"name {name!r} is not the key's name {key_name!r}")
    role = value.get("role")
    if role not in ROLES:
        raise EntryError(f"role must be one of {ROLES}")
    addresses = value.get("addresses")
    if not isinstance(addresses, dict) or len(addresses) > 8:
        raise EntryError("addresses must be an object")
    peer = check_address(addresses.get("peer"), "addresses.peer")
    server = addresses.get("server", "")
    if server and (not isinstance(server, str) or not URL_RE.match(server)):
        raise EntryError("addresses.server must be an http(s) URL")
    raw_load = value.get("load", {})
    if not isinstance(raw_load, dict):
        raise EntryError("load must be an object")
    load = Load(_count(raw_load.get("queued_bytes", 0), "queued_bytes", True),
                _count(raw_load.get("transfers", 0), "transfers", True),
                _count(raw_load.get("link_bps", 0), "link_bps", False))
    return Entry(name, role, peer, server, load)


def key_name(prefix: bytes, key: bytes) -> Optional[str]:
    """The peer name of a key under ``prefix`` (None: not a peer key: nested, empty, not a valid name)."""
    if not key.startswith(prefix) or len(key) - len(prefix) > 128:
        return None
    try:
        name = key[len(prefix):].decode("ascii")
    except UnicodeDecodeError:
        return None
    return None if "/" in name or check_peer_name(name) else name


def summary(entries: Dict[str, Entry]) -> Dict[str, dict]:
    """Entries as Stats shows them."""
    return {n: {"role": e.role, "peer": e.peer, "server": e.server, "load": e.load.as_dict()}
            for n, e in sorted(entries.items())}
