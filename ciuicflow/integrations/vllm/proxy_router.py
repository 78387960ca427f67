"""Where the proxy sends a request: the prefill and decode servers from static lists or from the registry
(proxy_registry.py), and the choice among them."""
from __future__ import annotations

import itertools
import math
import threading
import urllib.parse
from typing import List, Optional, Tuple


def upstream_url(url: str) -> str:
    """``url``, if the proxy can reach it: plain ``http://HOST[:PORT]`` (an ``https`` URL would be spoken
    to in cleartext, on port 80)."""
    u = urllib.parse.urlsplit(url)
    try:
        u.port
    except ValueError:
        raise ValueError(f"upstream URL {url!r}: invalid port") from None
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"upstream URL {url!r}: want http://HOST[:PORT] (the proxy speaks plain HTTP)")
    return url


def _reachable(url: str) -> bool:
    """Whether the proxy can speak to a registered server URL (upstream_url; an https one is skipped)."""
    try:
        upstream_url(url)
        return True
    except ValueError:
        return False


class Router:
    """Static lists: round robin over prefill instances and over (decode URL, decode sidecar peer).
    With ``registry`` (proxy_registry.RegistryView): the servers the sidecars registered, prefill round
    robin, decode by ``routing``: "load" (the least busy by proxy_registry.decode_score) or "round-robin"."""

    def __init__(self, prefill: List[str], decode: List[Tuple[str, str]], timeout: float = 600.0,
                 registry=None, routing: str = "load"):
        if registry is None and (not prefill or not decode):
            raise ValueError("need at least one --prefill and one --decode (or --discovery)")
        if routing not in ("load", "round-robin"):
            raise ValueError(f"routing must be 'load' or 'round-robin', not {routing!r}")
        for url in [*prefill, *(u for u, _ in decode)]:
            upstream_url(url)
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"upstream timeout must be a positive number of seconds, not {timeout!r}")
        self.prefill, self.decode, self.timeout = prefill, decode, timeout
        self.registry, self.routing = registry, routing
        self._p, self._d = itertools.cycle(prefill), itertools.cycle(decode)
        self._turn = itertools.count()
        self._routed: dict = {}             # decode peer -> requests sent there, not finished
        self._at_sample: dict = {}          # decode peer -> _routed[peer] when its latest load sample arrived
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "prefill_failed": 0}
        if registry is not None and hasattr(registry, "listeners"):
            registry.listeners.append(self._sampled)

    def _sampled(self, name: str, entry) -> None:
        """A registry entry (its load sample) arrived for ``name`` (None: it went). Called by the registry
        with its lock held: the registry's lock, then this one, never the other way round (pick() reads
        the servers before taking this lock)."""
        with self._lock:
            if entry is None:
                self._at_sample.pop(name, None)
            else:
                self._at_sample[name] = self._routed.get(name, 0)

    def pick(self) -> Tuple[str, str, str]:
        """(prefill URL, decode URL, decode sidecar's name) for the next request; call ``done(peer)`` after
        it. RuntimeError when the registry has none of either."""
        servers = self.registry.servers() if self.registry is not None else None    # before self._lock
        with self._lock:
            self.stats["requests"] += 1
            if servers is None:
                choice = next(self._p), *next(self._d)
            else:
                choice = self._pick_registered(*servers)
            self._routed[choice[2]] = self._routed.get(choice[2], 0) + 1
            return choice

    def _pick_registered(self, prefills, decodes) -> Tuple[str, str, str]:
        from .proxy_registry import decode_score
        prefills = [e for e in prefills if _reachable(e.server)]
        decodes = [e for e in decodes if _reachable(e.server)]
        if not prefills or not decodes:
            raise RuntimeError("no prefill or no decode server registered")
        turn = next(self._turn)
        prefill = prefills[turn % len(prefills)]
        if self.routing == "round-robin":
            decode = decodes[turn % len(decodes)]
        else:       # ties go round robin, so equal servers share the requests
            decode = min(decodes, key=lambda e: (decode_score(e, self._routed.get(e.name, 0),
                                                              self._at_sample.get(e.name, 0)),
                                                 (decodes.index(e) - turn) % len(decodes)))
        return prefill.server, decode.server, decode.name

    def done(self, peer: str) -> None:
        with self._lock:
            left = self._routed.get(peer, 0) - 1
            if left > 0:
                self._routed[peer] = left
            else:
                self._routed.pop(peer, None)

    def any_decode(self) -> Optional[str]:
        if self.registry is None:
            return self.decode[0][0]
        decodes = self.registry.servers()[1]
        return decodes[0].server if decodes else None

    def count(self, what: str) -> None:
        with self._lock:
            self.stats[what] = self.stats.get(what, 0) + 1
