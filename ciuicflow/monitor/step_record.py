"""One step's record, from the sources' differences, the phases' times and the user's metrics
(its fields are listed in ``ciuicflow.monitor.monitor``'s docstring)."""
from __future__ import annotations

import time

from ciuicflow.monitor.sources import combine, ratio


def step_record(index: int, step_s: float, sources, error_norm_every: int, phases: dict,
                metrics: dict) -> dict:
    """Read every source's difference since the last step and make step ``index``'s record."""
    deltas, reported_norms = [], []
    for source in sources:
        delta, norm = source.delta()
        deltas.append(delta)
        if norm is not None:
            reported_norms.append(norm)
    total = combine(deltas)
    comm_s = total["time_s"]
    sent = total["intra_node_bytes"] + total["inter_node_bytes"]
    exact = total["exact_intra_node_bytes"] + total["exact_inter_node_bytes"]
    record = {
        "type": "step", "step": index, "time": time.time(), "step_s": step_s,
        "comm_s": comm_s, "compute_s": max(step_s - comm_s, 0.0),
        "comm_fraction": min(comm_s / step_s, 1.0) if step_s > 0 else 0.0,
        "intra_node_bytes": total["intra_node_bytes"],
        "inter_node_bytes": total["inter_node_bytes"],
        "exact_intra_node_bytes": total["exact_intra_node_bytes"],
        "exact_inter_node_bytes": total["exact_inter_node_bytes"],
        "compression_ratio": ratio(exact, sent),
        "inter_node_compression_ratio": ratio(total["exact_inter_node_bytes"],
                                              total["inter_node_bytes"]),
        "error_feedback_norm": _error_norm(index, sources, error_norm_every, reported_norms),
        "relative_error": max((s.relative_error for s in sources
                               if s.relative_error is not None), default=None),
        "beyond_target_reductions": int(total["beyond_target_reductions"]),
    }
    wire = {s.name: s.wire_changed for s in sources if s.wire_changed}
    if wire:  # what a tensor sends, where it appeared or changed this step (and why: its reasons)
        record["wire"] = wire
    if phases:
        record["phases"] = phases
    if metrics:
        record["metrics"] = metrics
    return record


def _error_norm(index: int, sources, every: int, reported: list[float]) -> float | None:
    # computing a norm is a pass over gradient-sized buffers: only every `every` steps
    norms = list(reported)
    if every and index % every == 0:
        norms += [n for n in (s.compute_error_norm() for s in sources
                              if s.can_compute_error_norm()) if n is not None]
    if not norms:
        return None
    return sum(n * n for n in norms) ** 0.5
