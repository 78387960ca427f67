"""Per-step figures from cumulative statistics.

A source is a hook state (anything with ``stats() -> dict``, e.g. ``ciuicflow.OneBitState``) or a
zero-argument callable returning such a dict (an optimizer's counters, say). The dict holds
counters that only grow (until a ``reset_stats()``); the monitor reads them at every step end and
keeps the difference. Recognised keys, all optional:

- ``intra_node_bytes``, ``inter_node_bytes``: bytes this rank sent on each link class;
- ``exact_intra_node_bytes``, ``exact_inter_node_bytes``: what exact all-reduces would have sent;
- ``time_s``: seconds spent compressing and communicating;
- ``error_feedback_norm``: the current L2 norm of the error-feedback memory (not a counter);
- ``relative_error``: the accuracy guard's measure, ||error-feedback memory|| / ||gradient|| of
  the worst bucket at its last step (not a counter; ciuicflow's compressing hook states);
- ``beyond_target_reductions``: tensors sent with more than the method's own codec (a counter);
- ``wire``: per tensor, what its last step sent (``compression.policy.WirePlan.as_dict``, not a
  counter): the monitor records a tensor's plan when it first appears and each time it changes.

When a ciuicflow hook state does not report ``error_feedback_norm``, it is computed from the error
buffers in its ``state_dict()["memory"]`` (tensors named ``worker``/``server`` for 1-bit, ``error``
for PowerSGD): a pass over gradient-sized buffers, so the monitor does it only every few steps.
Other sources (optimizers) report the norm themselves or not at all.
"""
from __future__ import annotations

from typing import Callable

COUNTER_KEYS = ("intra_node_bytes", "inter_node_bytes", "exact_intra_node_bytes",
                "exact_inter_node_bytes", "time_s", "beyond_target_reductions")
ERROR_BUFFER_NAMES = ("worker", "server", "error")


class StatsSource:
    """One source of cumulative statistics, read as per-step differences."""

    def __init__(self, source):
        if callable(getattr(source, "stats", None)):
            self._read: Callable[[], dict] = source.stats
            self.owner = source
        elif callable(source):
            self._read, self.owner = source, None
        else:
            raise TypeError(f"a monitor source needs a stats() method or must be callable, got "
                            f"{type(source).__name__}")
        self.name = getattr(source, "algorithm", None) or type(source).__name__
        self.relative_error = None  # last read
        first = self._read_checked()
        self._last = self._counters(first)  # traffic before the monitor is not ours
        self.wire: dict = dict(first.get("wire") or {})  # tensor -> its plan, last read
        self.wire_changed: dict = {}  # tensors whose plan appeared or changed at the last read

    def _read_checked(self) -> dict:
        stats = self._read()
        if not isinstance(stats, dict):
            raise TypeError(f"{self.name}: stats() must return a dict, got {type(stats).__name__}")
        return stats

    @staticmethod
    def _counters(stats: dict) -> dict:
        return {key: float(stats.get(key) or 0.0) for key in COUNTER_KEYS}

    def delta(self) -> tuple[dict, float | None]:
        """Counter increments since the last call, and the reported error-feedback norm (or None)."""
        stats = self._read_checked()
        current = self._counters(stats)
        delta = {key: current[key] - self._last[key] for key in COUNTER_KEYS}
        if any(value < 0 for value in delta.values()):  # reset_stats() ran: count from zero
            delta = current
        self._last = current
        self.relative_error = stats.get("relative_error")
        wire = stats.get("wire") or {}
        self.wire_changed = {key: plan for key, plan in wire.items() if self.wire.get(key) != plan}
        self.wire = wire
        norm = stats.get("error_feedback_norm")
        return delta, (float(norm) if norm is not None else None)

    def can_compute_error_norm(self) -> bool:
        """Only for ciuicflow's hook states, whose state_dict is known to be cheap and to hold
        the memory (an optimizer's state_dict may copy every buffer)."""
        if self.owner is None:
            return False
        from ciuicflow.ddp.state import AllReduceState

        return isinstance(self.owner, AllReduceState)

    def compute_error_norm(self) -> float | None:
        """L2 norm over the error buffers in the owner's ``state_dict()["memory"]``, or None."""
        if not self.can_compute_error_norm():
            return None
        memory = self.owner.state_dict().get("memory") or {}
        tensors = []
        for entry in memory.values():
            buffers = entry.get("tensors", {}) if isinstance(entry, dict) else {}
            tensors += [t for name, t in buffers.items()
                        if name in ERROR_BUFFER_NAMES and t is not None and t.numel()]
        if not tensors:
            return None
        import torch

        # one host sync per device, not per buffer
        total = 0.0
        for device in {t.device for t in tensors}:
            norms = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors
                                 if t.device == device])
            total += float(norms.double().square().sum())
        return total ** 0.5


def combine(deltas: list[dict]) -> dict:
    """Sum the per-step increments of several sources."""
    total = dict.fromkeys(COUNTER_KEYS, 0.0)
    for delta in deltas:
        for key in COUNTER_KEYS:
            total[key] += delta[key]
    return total


def ratio(exact: float, actual: float) -> float | None:
    return exact / actual if actual > 0 else None
