"""What a compressing glue (DDP hooks, FSDP) records for ``stats()``: bytes, steps, time, the guard.

One ``Ledger`` per state. ``record`` takes each tensor's ``Traffic``; ``end_step`` closes a step;
``note_guard`` keeps a tensor's relative error and warns past the compressor's threshold.
"""
from __future__ import annotations

import warnings

from ciuicflow.collectives.primitives import Traffic


def _ratio(exact: float, actual: float):
    return exact / actual if actual else None


class Ledger:
    def __init__(self):
        self._warned: set[str] = set()
        self.reset()

    def reset(self) -> None:
        self.traffic = Traffic()             # every step
        self.compressed_traffic = Traffic()  # steps past warm-up
        self.time_s = 0.0
        self.steps = 0
        self.compressed_steps = 0
        self.tensors = 0  # buckets (DDP) or parameter groups (FSDP) reduced
        self.relative_errors: dict = {}  # tensor index or name -> the guard's last measure
        self.guard_alerts = 0

    def record(self, traffic: Traffic, compressed: bool, seconds: float) -> None:
        self.traffic.merge(traffic)
        if compressed:
            self.compressed_traffic.merge(traffic)
        self.tensors += 1
        self.time_s += seconds

    def end_step(self, compressed: bool) -> None:
        self.steps += 1
        self.compressed_steps += int(compressed)

    def note_guard(self, compressor, algorithm: str, key, what: str,
                   relative_error: float | None) -> None:
        """Record ``key``'s relative error; above the threshold, warn (once per key)."""
        if relative_error is None or compressor.guard == "off":
            return
        self.relative_errors[key] = relative_error
        if relative_error > compressor.guard_threshold:
            self.guard_alerts += 1
            action = ("its next step is exact" if compressor.guard == "exact" else
                      "pass guard='exact' to send it exactly then, or reduce the learning rate, "
                      "the momentum, or raise the rank/lower the chunk size")
            self.warn_once(f"guard{key}", (
                f"ciuicflow {algorithm}: {what}'s error-feedback memory is "
                f"{relative_error:.1f}x its gradient (threshold {compressor.guard_threshold}): "
                f"compression is falling behind and may cost accuracy; {action}"))

    def warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def stats(self, algorithm: str, topology) -> dict:
        """Bytes follow the model of ``ciuicflow.collectives`` (bytes this rank sends); the
        ``exact_*`` figures are what exact all-reduces along the same path would send.
        ``compression_ratio`` = exact / actual inter-node bytes over the steps past warm-up
        (``overall_compression_ratio``: over all steps). ``time_s``: time spent compressing and
        communicating."""
        t, c, steps = self.traffic, self.compressed_traffic, self.steps
        return {
            "algorithm": algorithm,
            "topology": topology.describe() if topology is not None else None,
            "steps": steps,
            "compressed_steps": self.compressed_steps,
            "buckets": self.tensors,
            "intra_node_bytes": int(round(t.intra_bytes)),
            "inter_node_bytes": int(round(t.inter_bytes)),
            "exact_intra_node_bytes": int(round(t.exact_intra_bytes)),
            "exact_inter_node_bytes": int(round(t.exact_inter_bytes)),
            "inter_node_bytes_per_step": t.inter_bytes / steps if steps else 0.0,
            "compression_ratio": _ratio(c.exact_inter_bytes, c.inter_bytes),
            "overall_compression_ratio": _ratio(t.exact_inter_bytes, t.inter_bytes),
            "nonfinite_fallbacks": t.nonfinite_fallbacks,
            # the accuracy guard: ||error-feedback memory|| / ||gradient|| per tensor, last step
            "relative_error": max(self.relative_errors.values()) if self.relative_errors
            else None,
            "relative_errors": dict(self.relative_errors),
            "guard_alerts": self.guard_alerts,
            "guard_exact_steps": t.guard_exact_steps,
            "time_s": self.time_s,
            "time_per_step_s": self.time_s / steps if steps else 0.0,
        }

    def state_dict(self) -> dict:
        return {"traffic": self.traffic.as_dict(),
                "compressed_traffic": self.compressed_traffic.as_dict(),
                "time_s": self.time_s, "steps": self.steps,
                "compressed_steps": self.compressed_steps, "buckets": self.tensors}

    def load_state_dict(self, stats: dict) -> None:
        self.traffic = Traffic(**stats.get("traffic", {}))
        self.compressed_traffic = Traffic(**stats.get("compressed_traffic", {}))
        self.time_s = stats.get("time_s", 0.0)
        self.steps = stats.get("steps", 0)
        self.compressed_steps = stats.get("compressed_steps", 0)
        self.tensors = stats.get("buckets", 0)
