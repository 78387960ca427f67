"""The soak's ledger: what every process wrote, durably, as it happened, and the verdict drawn from it.

Each process appends JSON lines to a file of its own (``Ledger``; flushed and fsynced per line, so a process
killed with SIGKILL loses at most the line it was writing):

* senders: ``intent`` (key, src, dest, size, sha) before a send, ``ok`` once ``wait()`` returned OK,
  ``gave_up`` after retrying for too long;
* consumers: ``delivered`` (key, sha_ok, t0: when the receive began) once a transfer was received whole,
  ``acked`` once ``ack`` returned;
* the orchestrator: ``kill`` (who, t) for every SIGKILL it sent, ``crash`` for a sidecar that exited by
  itself, ``worker_crash`` for a client process that failed by itself (an exception the Client let out).

``verdict(events, memory_receivers)``: acknowledged transfers lost (an ``ok`` never ``delivered`` intact),
duplicates (a delivery that began after the key was acknowledged by a consumer), corrupted deliveries.
A loss is *allowed* only where the guarantees allow it (docs/kvflow.md, Delivery guarantees): a receiver
without spool and its sender both killed between the ``ok`` and the end.
"""
from __future__ import annotations

import glob
import json
import os
import time
from typing import Dict, Iterable, List


class Ledger:
    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, ev: str, **fields) -> None:
        line = json.dumps({"ev": ev, "t": time.monotonic(), **fields}) + "\n"
        os.write(self.fd, line.encode())
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def read_all(directory: str) -> List[dict]:
    """Every event of every ledger file in ``directory`` (a torn last line is skipped)."""
    events = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path) as fh:
            for line in fh:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    return events


def acked_keys(events: Iterable[dict]) -> set:
    return {e["key"] for e in events if e["ev"] == "acked"}


def verdict(events: List[dict], memory_receivers=()) -> Dict:
    oks: Dict[str, dict] = {}
    for e in events:
        if e["ev"] == "ok":
            oks.setdefault(e["key"], e)
    intents = {e["key"] for e in events if e["ev"] == "intent"}
    first_ack: Dict[str, float] = {}
    for e in events:
        if e["ev"] == "acked":
            first_ack[e["key"]] = min(first_ack.get(e["key"], e["t"]), e["t"])
    delivered_ok, corrupted, duplicates, redelivered = set(), [], [], 0
    seen = set()
    for e in sorted((e for e in events if e["ev"] == "delivered"), key=lambda e: e["t0"]):
        if not e["sha_ok"]:
            corrupted.append(e["key"])
            continue
        if e["key"] in first_ack and e["t0"] > first_ack[e["key"]]:
            duplicates.append(e["key"])
        elif e["key"] in seen:
            redelivered += 1            # again before any consumer acknowledged it: at-least-once, by design
        seen.add(e["key"])
        delivered_ok.add(e["key"])
    kills = [e for e in events if e["ev"] == "kill"]
    lost, allowed = [], []
    for key, ok in oks.items():
        if key in delivered_ok:
            continue
        killed = {k["who"] for k in kills if k["t"] > ok["t"]}
        if ok["dest"] in memory_receivers and ok["dest"] in killed and ok["src"] in killed:
            allowed.append(key)
        else:
            lost.append(key)
    return {
        "intents": len(intents),
        "acknowledged": len(oks),
        "delivered": len(delivered_ok),
        "gave_up": sum(1 for e in events if e["ev"] == "gave_up"),
        "redelivered_before_ack": redelivered,
        "lost": sorted(lost),
        "lost_allowed": sorted(allowed),
        "duplicates": sorted(set(duplicates)),
        "corrupted": sorted(set(corrupted)),
        "kills": len(kills),
        "crashes": sorted({e["who"] for e in events if e["ev"] == "crash"}),
        "worker_crashes": sorted({e["who"] for e in events if e["ev"] == "worker_crash"}),
        # senders still busy when the drain ended (killed then; not a failure: what they had
        # not been told OK is not counted as acknowledged)
        "drain_timeouts": sorted({e["who"] for e in events if e["ev"] == "drain_timeout"}),
        "bytes_acknowledged": sum(ok["size"] for ok in oks.values()),
    }


def passed(v: Dict) -> bool:
    return not (v["lost"] or v["duplicates"] or v["corrupted"] or v["crashes"] or v["worker_crashes"]) \
        and v["acknowledged"] > 0
