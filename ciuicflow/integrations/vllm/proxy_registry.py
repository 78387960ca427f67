"""The proxy's view of the registry (``--discovery etcd://HOST:PORT/PREFIX``): the prefill and decode servers
the sidecars registered (their ``--server-url`` and role) and the load each sidecar reports, kept current by
a watch; and the choice of a decode server by that load.

The proxy is standard library only, so it reads etcd through etcd's JSON gateway (``/v3/kv/range``,
``/v3/watch``: the same port as gRPC) with http.client. Entries are checked as the sidecars check them
(ciuicflow/kvflow/discovery/entry.py); the registry grants the proxy no trust either: it only decides where
a request goes, and the sidecars authenticate each other whatever it decides.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from ...kvflow.discovery.entry import MAX_VALUE_BYTES, Entry, EntryError, decode, key_name

log = logging.getLogger("ciuicflow.vllm.proxy")

MAX_ENTRIES = 1024              # registry entries taken at most
MAX_LINE = 4 * MAX_VALUE_BYTES * 8 + 4096       # one watch message (a few events of bounded values)
BACKOFF_MAX_S = 2.0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    end[-1] += 1            # prefixes end in "/" (0x2f): never 0xff
    return bytes(end)


def decode_score(entry: Entry, routed: int, routed_at_sample: int = 0) -> Tuple[int, float, int]:
    """How busy a decode server is, lowest first: the transfers in flight at its sidecar that this proxy did
    not send, plus the requests this proxy sent it that have not finished; then the seconds its queued bytes
    take at its link's estimated rate, then the bytes.

    The registry's figures are samples (``--discovery-load-s``, a second by default): the transfers a sample
    counts include this proxy's own requests then in flight, which may have finished since, and the proxy's
    own count is current. So each of its requests counts once, by that count: of the reported transfers,
    only those beyond ``routed_at_sample`` (the proxy's requests to that server not finished when the
    sample arrived, each with at most one transfer) are someone else's. Adding the whole sample to the
    proxy's count (as before) counted a request twice while its transfer ran and kept counting it for up
    to a sampling period after it had finished, which made idle servers look busy."""
    load = entry.load
    drain_s = load.queued_bytes / load.link_bps if load.link_bps > 0 else float(load.queued_bytes > 0)
    others = max(0, load.transfers - routed_at_sample)
    return others + routed, drain_s, load.queued_bytes


class RegistryView:
    """Entries under ``prefix`` in the etcd at ``endpoint`` (HOST:PORT), kept by a watch in a thread."""

    def __init__(self, endpoint: str, prefix: str, timeout: float = 5.0):
        self.host, _, port = endpoint.rpartition(":")
        self.port = int(port)
        self.prefix = (prefix.rstrip("/") + "/").encode()
        self.timeout = timeout
        self.entries: Dict[str, Entry] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.synced = threading.Event()
        self.listeners: List[Callable[[str, Optional[Entry]], None]] = []     # called with the lock held
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy-registry", daemon=True)

    def start(self) -> "RegistryView":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def servers(self) -> Tuple[List[Entry], List[Entry]]:
        """(prefill servers, decode servers) registered with a server URL, by name."""
        with self.lock:
            entries = sorted(self.entries.values(), key=lambda e: e.name)
        with_url = [e for e in entries if e.server]
        return ([e for e in with_url if e.role in ("prefill", "both")],
                [e for e in with_url if e.role in ("decode", "both")])

    def _notify(self, name: str, entry: Optional[Entry]) -> None:
        """Tell the listeners (the Router) that ``name``'s entry arrived (None: it went), under the lock: the
        entry and what a listener records about it change together. A listener must not take this lock."""
        for listener in self.listeners:
            try:
                listener(name, entry)
            except Exception:  # noqa: BLE001 - a listener's bug must not end the watch
                log.exception("registry listener failed")

    # ------------------------------------------------------------------ etcd's JSON gateway
    def _post(self, path: str, body: dict, timeout: Optional[float]):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise OSError(f"etcd {path}: HTTP {resp.status}")
        return conn, resp

    def _parse(self, kv: dict) -> Tuple[Optional[str], Optional[Entry]]:
        try:
            key = base64.b64decode(kv.get("key", ""), validate=True)
            name = key_name(self.prefix, key)
            if name is None:
                return None, None
            value = base64.b64decode(kv.get("value", ""), validate=True)
            return name, decode(name, value)
        except (EntryError, ValueError, TypeError, AttributeError) as exc:
            log.warning("registry entry ignored: %s", exc)
            return None, None

    def _range(self) -> int:
        conn, resp = self._post("/v3/kv/range", {"key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix)),
                                                 "limit": MAX_ENTRIES}, self.timeout)
        try:
            data = resp.read(MAX_ENTRIES * (2 * MAX_VALUE_BYTES + 1024))
        finally:
            conn.close()
        reply = json.loads(data)
        entries = {}
        for kv in reply.get("kvs", [])[:MAX_ENTRIES]:
            name, entry = self._parse(kv)
            if entry is not None:
                entries[name] = entry
        with self.changed:
            gone = set(self.entries) - set(entries)
            self.entries = entries
            for name in gone:
                self._notify(name, None)
            for name, entry in entries.items():
                self._notify(name, entry)
            self.changed.notify_all()
        self.synced.set()
        return int(reply.get("header", {}).get("revision", 0))

    def _watch(self, revision: int) -> None:
        conn, resp = self._post("/v3/watch", {"create_request": {
            "key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix)), "start_revision": revision + 1}},
            None)
        try:
            while not self._stop.is_set():
                line = resp.readline(MAX_LINE)
                if not line:
                    raise OSError("etcd watch ended")
                result = json.loads(line).get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    raise OSError("etcd watch canceled")
                for event in result.get("events", []):
                    kv = event.get("kv", {})
                    if event.get("type") == "DELETE":
                        name = key_name(self.prefix, base64.b64decode(kv.get("key", "")))
                        entry = None
                    else:
                        name, entry = self._parse(kv)
                    if name is None:
                        continue
                    with self.changed:
                        if entry is None:
                            if self.entries.pop(name, None) is not None:
                                self._notify(name, None)
                        elif name in self.entries or len(self.entries) < MAX_ENTRIES:
                            self.entries[name] = entry
                            self._notify(name, entry)
                        self.changed.notify_all()
        finally:
            conn.close()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                revision = self._range()
                backoff = 0.1
                self._watch(revision)
            except (OSError, ValueError, http.client.HTTPException) as exc:
                log.warning("registry: %s (the servers known are kept; retrying)", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
