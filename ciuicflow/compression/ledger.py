"""What a compressing glue (DDP hooks, FSDP) records for ``stats()``: bytes, steps, time, the guard.

One ``Ledger`` per state. ``start`` and ``record`` bracket each tensor's reduction and take its
``Traffic``; ``end_step`` closes a step; ``note_guard`` keeps a tensor's relative error and warns
past the compressor's threshold; ``note_plan`` keeps what each tensor's last step sent
(``compression.policy.WirePlan``) and counts, with the reason, each time that changes.
"""
from __future__ import annotations

import logging
import time
import warnings

import torch

from ciuicflow.collectives.primitives import Traffic

log = logging.getLogger("ciuicflow.compression")


def _ratio(exact: float, actual: float):
    return exact / actual if actual else None


class Ledger:
    def __init__(self):
        self._warned: set[str] = set()
        self.reset()

    def reset(self) -> None:
        self.traffic = Traffic()             # every step
        self.compressed_traffic = Traffic()  # steps past warm-up
        self._time_s = 0.0
        self._pending: list = []  # (start, end) CUDA events not yet added to _time_s
        self.steps = 0
        self.compressed_steps = 0
        self.tensors = 0  # buckets (DDP) or parameter groups (FSDP) reduced
        self.relative_errors: dict = {}  # tensor index or name -> the guard's last measure
        self.guard_alerts = 0
        self.plans: dict = {}  # tensor index or name -> the WirePlan its last step sent
        self.plan_changes: dict = {}  # tensor index or name -> times its plan changed

    @staticmethod
    def start(device: torch.device):
        """A mark for ``record``: the host clock on the CPU; on CUDA an event on the current
        stream, as the host returns long before asynchronous (NCCL) work has run."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def record(self, traffic: Traffic, compressed: bool, started) -> None:
        """One tensor reduced since ``started`` (from ``start``)."""
        self.traffic.merge(traffic)
        if compressed:
            self.compressed_traffic.merge(traffic)
        self.tensors += 1
        if isinstance(started, float):
            self._time_s += time.perf_counter() - started
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((started, end))
            self._settle(wait=False)

    def _settle(self, wait: bool) -> None:
        """Add the device time of finished event pairs (all of them if ``wait``: a host sync,
        only where stats are read)."""
        while self._pending and (wait or self._pending[0][1].query()):
            begin, end = self._pending.pop(0)
            end.synchronize()
            self._time_s += begin.elapsed_time(end) / 1000.0

    @property
    def time_s(self) -> float:
        """Seconds spent compressing and communicating (device time on CUDA)."""
        self._settle(wait=True)
        return self._time_s

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
                      "its next step is sent in float16" if compressor.guard == "fp16" else
                      "pass guard='exact' (or 'fp16') to send it exactly then, or reduce the "
                      "learning rate, the momentum, or raise the rank/lower the chunk size")
            self.warn_once(f"guard{key}", (
                f"ciuicflow {algorithm}: {what}'s error-feedback memory is "
                f"{relative_error:.1f}x its gradient (threshold {compressor.guard_threshold}): "
                f"compression is falling behind and may cost accuracy; {action}"))

    def note_plan(self, key, what: str, plan) -> None:
        """Keep ``key``'s plan (None: the compressor plans nothing); a change from its last one is
        counted and logged with the new plan's reasons."""
        if plan is None:
            return
        last = self.plans.get(key)
        self.plans[key] = plan
        if last is not None and last != plan:
            self.plan_changes[key] = self.plan_changes.get(key, 0) + 1
            log.info("ciuicflow %s: %s now sends %s (was %s): %s", plan.method, what,
                     plan.describe().split("\n")[0], last.describe().split("\n")[0],
                     "; ".join(plan.reasons))

    def note_adaptive(self, compressor, algorithm: str, adaptive: bool, route=None,
                      device=None) -> None:
        """Say once that an adaptive optimizer's tensors go with another codec than the
        compressor's own (``QuantizedCompressor.codec_for``) on ``route`` (None: the
        reduce-scatter form) from ``device``."""
        codec_for = getattr(compressor, "codec_for", None)
        if not adaptive or codec_for is None \
                or codec_for(True, route, device) is compressor.own_codec(route):
            return
        self.warn_once("adaptive", (
            f"ciuicflow {algorithm}: an adaptive optimizer (Adam, AdamW, ...: anything but SGD) "
            f"steps these parameters, and {compressor.codec.name} error feedback under it trains "
            f"as if at a smaller learning rate, so they are sent as "
            f"{codec_for(True, route, device).name} "
            "(docs/hooks.md, \"Adaptive optimizers\"); ciuicflow.OneBitAdam compresses Adam to "
            "1 bit without that loss; adaptive_optimizer='int4' sends them at 4 bits everywhere "
            "(closest to exact), 'same' keeps the codec"))

    def warn_once(self, tag: str, message: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def stats(self, algorithm: str, topology) -> dict:
        """Bytes follow the model of ``ciuicflow.collectives`` (bytes this rank sends); the
        ``exact_*`` figures are what exact all-reduces along the same path would send.
        ``compression_ratio`` = exact / actual inter-node bytes over the steps past warm-up
        (``overall_compression_ratio``: over all steps). ``time_s``: time spent compressing and
        communicating (on CUDA, the stream's time between events around each reduction)."""
        t, c, steps, time_s = self.traffic, self.compressed_traffic, self.steps, self.time_s
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
            # reductions sent with the codec for adaptive optimizers' tensors
            "adaptive_codec_reductions": t.adaptive_codec_reductions,
            # reductions whose workers or servers sent more than the method's own codec
            "beyond_target_reductions": t.beyond_target_reductions,
            # per tensor: what its last step sent (compression.policy.WirePlan), and how often
            # that changed
            "wire": {key: {**plan.as_dict(), "changes": self.plan_changes.get(key, 0)}
                     for key, plan in self.plans.items()},
            "time_s": time_s,
            "time_per_step_s": time_s / steps if steps else 0.0,
        }

    def state_dict(self) -> dict:
        return {"traffic": self.traffic.as_dict(),
                "compressed_traffic": self.compressed_traffic.as_dict(),
                "time_s": self.time_s, "steps": self.steps,
                "compressed_steps": self.compressed_steps, "buckets": self.tensors}

    def load_state_dict(self, stats: dict) -> None:
        self.traffic = Traffic(**stats.get("traffic", {}))
        self.compressed_traffic = Traffic(**stats.get("compressed_traffic", {}))
        self._time_s, self._pending = stats.get("time_s", 0.0), []
        self.steps = stats.get("steps", 0)
        self.compressed_steps = stats.get("compressed_steps", 0)
        self.tensors = stats.get("buckets", 0)
