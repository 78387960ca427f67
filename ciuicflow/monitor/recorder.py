"""The run directory: one JSON-lines file per rank, and its reader.

``RUN_DIR/rank00003.jsonl`` holds, one JSON object a line:

- ``{"type": "meta", ...}`` first: run id, rank, world size, node of every rank, host, traffic
  model, sources, start time;
- ``{"type": "step", ...}`` per step (see ``Monitor``);
- ``{"type": "alert", ...}`` per straggler or hang alert (written by the rank that detected it);
- ``{"type": "end", ...}`` last, when the monitor was closed.

The reader skips a torn last line (a crash mid-write) and files of an older run found in the same
directory (another run id than rank 0's). This module imports no torch, for ``ciuicflow report``.
"""
from __future__ import annotations

import glob
import json
import os
import re
import threading
import warnings
from dataclasses import dataclass, field

FORMAT_VERSION = 1
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # built once: json.dumps(separators=) builds one per call
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")


def rank_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank:05d}.jsonl")


class RunRecorder:
    """Writes one rank's records. Thread-safe: the hang watchdog writes alerts from its thread."""

    def __init__(self, run_dir: str, rank: int, meta: dict, flush_every: int = 10):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        os.makedirs(run_dir, exist_ok=True)
        self.path = rank_file(run_dir, rank)
        self._file = open(self.path, "w", encoding="utf-8")
        self._lock = threading.Lock()
        self._flush_every = flush_every
        self._unflushed = 0
        self._write(dict(meta, type="meta", format=FORMAT_VERSION), flush=True)

    def _write(self, record: dict, flush: bool = False) -> None:
        # NaN/Infinity (a diverged loss) are written as Python's json reads them back
        line = _ENCODER.encode(record) + "\n"
        with self._lock:
            if self._file is None:
                return
            self._file.write(line)
            self._unflushed += 1
            if flush or self._unflushed >= self._flush_every:
                self._file.flush()
                self._unflushed = 0

    def step(self, record: dict) -> None:
        self._write(record)

    def alert(self, alert: dict) -> None:
        self._write(alert, flush=True)  # an alert may precede a crash

    def close(self, summary: dict | None = None) -> None:
        if self._file is None:
            return
        self._write(dict(summary or {}, type="end"), flush=True)
        with self._lock:
            self._file.close()
            self._file = None


# ------------------------------------------------------------------------------------------------
# Reading


@dataclass
class Run:
    """A recorded run: per-rank meta and steps, and every alert."""

    run_dir: str
    run_id: str
    world_size: int
    node_of_rank: list[int]
    traffic_model: str
    metas: dict[int, dict] = field(default_factory=dict)
    steps: dict[int, list[dict]] = field(default_factory=dict)
    alerts: list[dict] = field(default_factory=list)
    ends: dict[int, dict] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.metas)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of_rank) + 1 if self.node_of_rank else 1


def _read_lines(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number >= len(lines) - 1:  # the torn last line of a crashed writer
                warnings.warn(f"{path}: line {number} is incomplete and was skipped")
                continue
            raise ValueError(f"{path}: line {number} is not JSON") from None
    return records


def load_run(run_dir: str) -> Run:
    """Read a run directory written by ``Monitor``; raises ``FileNotFoundError``/``ValueError``."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    paths = sorted(p for p in glob.glob(os.path.join(run_dir, "rank*.jsonl"))
                   if _RANK_FILE.search(p))
    if not paths:
        raise FileNotFoundError(f"{run_dir!r} holds no rank*.jsonl files: was it written by "
                                "ciuicflow.monitor.Monitor(run_dir=...)?")
    files = {}
    for path in paths:
        records = _read_lines(path)
        if not records or records[0].get("type") != "meta":
            raise ValueError(f"{path} does not start with a meta record")
        files[int(_RANK_FILE.search(path).group(1))] = records
    newest = max(files.values(), key=lambda r: r[0].get("start_time", 0.0))[0]
    run_id = newest["run_id"]
    stale = sorted(rank for rank, records in files.items() if records[0]["run_id"] != run_id)
    if stale:
        warnings.warn(f"{run_dir}: files of ranks {stale} belong to another run and are ignored")
    run = Run(run_dir, run_id, int(newest["world_size"]), list(newest["node_of_rank"]),
              newest.get("traffic_model", "flat"))
    for rank, records in files.items():
        if rank in stale:
            continue
        run.metas[rank] = records[0]
        run.steps[rank] = [r for r in records if r.get("type") == "step"]
        run.alerts += [r for r in records if r.get("type") == "alert"]
        ends = [r for r in records if r.get("type") == "end"]
        if ends:
            run.ends[rank] = ends[-1]
    run.alerts.sort(key=lambda a: a.get("time", 0.0))
    return run
