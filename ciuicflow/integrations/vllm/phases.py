"""Per-transfer timings, one log line each, for the serving benchmark's per-phase breakdown of TTFT
(bench/vllm/phases.py reads them back from the servers' logs):

    ciuicflow-phase {"side": "send", "key": ..., "priority": ..., "flow": ..., "t_open": ..., ...}

Wall-clock times (``time.time()``): the prefill server, the decode server and the load generator run on
one host (or in network namespaces of one host), so their stamps compare; durations are in seconds.
"""
from __future__ import annotations

import json
import logging

log = logging.getLogger("ciuicflow.vllm")
TAG = "ciuicflow-phase "


def log_phase(side: str, key: str, **fields) -> None:
    rec = {"side": side, "key": key}
    rec.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in fields.items()})
    log.info("%s%s", TAG, json.dumps(rec, sort_keys=True))


def parse_phases(lines):
    """The records of ``log_phase`` found in an iterable of log lines."""
    out = []
    for line in lines:
        i = line.find(TAG)
        if i < 0:
            continue
        try:
            out.append(json.loads(line[i + len(TAG):]))
        except ValueError:
            continue
    return out
