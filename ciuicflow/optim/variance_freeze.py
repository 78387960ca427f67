"""When Adam's variance may be frozen: measured, not guessed (``OneBitAdam``, ``ZeroOneAdam``).

The measure is how fast the preconditioner ``sqrt(v_hat) + eps`` still moves: the mean over the
elements that have a variance of its relative change per step over the last ``WINDOW`` steps
(each element's change capped at 100%, so a unit coming alive counts once, not a millionfold).
Adam's variance forgets ``1 - beta2`` of itself per step; it is *stable* once its preconditioner
moves no faster than that. The ranks take the largest of their measures, so every rank freezes on
the same step.

- ``"auto"`` (``OneBitAdam``'s ``freeze_steps``, ``ZeroOneAdam``'s ``var_freeze_step``): freeze
  after the first stable measure, never before ``FLOOR`` steps, and after ``CEILING_HORIZONS /
  (1 - beta2)`` steps at the latest (with a warning).
- an integer N: freeze after step N if the variance is stable by then. If not,
  ``hold_until_stable=True`` warns and goes on updating the variance until it is (or the
  ceiling); ``False`` warns and freezes after step N.

Until the freeze each parameter's state holds one more tensor, the preconditioner the current window
started from.
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("ciuicflow.optim")

AUTO = "auto"
WINDOW = 20  # steps a measure spans: long enough to average out one batch's noise
FLOOR = 2 * WINDOW  # the first step a freeze is judged at
CEILING_HORIZONS = 10  # by then the variance has forgotten its start ten times over
_SNAPSHOT_KEY = "variance_snapshot"  # per-parameter state: the preconditioner a window started at


@dataclass
class Measure:
    """The preconditioner's relative change per step over steps ``start``..``end``, in the
    group where it is largest against that group's ``1 - beta2`` (``threshold``)."""

    start: int
    end: int
    rate: float
    threshold: float

    @property
    def stable(self) -> bool:
        return self.rate <= self.threshold

    def describe(self) -> str:
        return (f"the preconditioner sqrt(v_hat) moved {self.rate:.3%} per step over steps "
                f"{self.start}-{self.end}, {'within' if self.stable else 'above'} the "
                f"{self.threshold:.3%} (1 - beta2) it calls stable")


def check_request(name: str, value) -> int | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value \
            or value < 1:
        raise ValueError(f"{name} must be 'auto' or an integer >= 1, got {value!r}")
    return int(value)


class VarianceFreeze:
    """Decides after which step an optimizer's variance freezes (see the module's docstring).

    ``after_step`` is called by every rank after every step until the freeze; it measures (a
    collective, every ``WINDOW`` steps on which the variance was updated) and says whether to
    freeze now. ``frozen_at`` and ``reason`` then say when and why."""

    def __init__(self, optimizer, argument: str, requested, hold: bool):
        self.optimizer = optimizer
        self.argument = argument  # the constructor argument, named in messages
        self.requested = check_request(argument, requested)
        self.hold = bool(hold)
        largest_beta2 = max(g["betas"][1] for g in optimizer.param_groups)
        self.ceiling = max(FLOOR, math.ceil(CEILING_HORIZONS / max(1e-12, 1 - largest_beta2)))
        self.snapshot_step: int | None = None
        self.last: Measure | None = None
        self.held = False
        self.frozen_at: int | None = None
        self.reason = ""

    # -- the decision --------------------------------------------------------------------------

    def after_step(self, buckets: list, step: int, variance_updated: bool,
                   variance_updates: int) -> bool:
        """Whether to freeze after ``step``; measures first when a window has passed."""
        if variance_updated:
            self._maybe_measure(buckets, step, variance_updates)
        freeze, message = self._decide(step)
        if freeze:
            self._freeze(step, message)
        return freeze

    def _decide(self, step: int) -> tuple[bool, str]:
        """(freeze after this step, the message saying why)."""
        name = type(self.optimizer).__name__
        stable = self.last is not None and self.last.stable and step >= FLOOR
        judged = self.last.describe() if self.last else "nothing measured yet"
        if self.requested == AUTO:
            if stable:
                return True, f"{name}: variance frozen after step {step}: {judged}"
            if step >= self.ceiling:
                return True, self._warn(f"{name}: variance frozen after step {step}, the ceiling "
                                        f"of {self.argument}='auto', although not stable: {judged}")
            return False, ""
        if step < self.requested:
            return False, ""
        asked = f"{self.argument}={self.requested}"
        if stable:
            return True, f"{name}: variance frozen after step {step} ({asked}): {judged}"
        unstable = f"not judged stable by step {step} ({judged}; never before step {FLOOR})"
        if not self.hold:
            return True, self._warn(f"{name}: variance frozen after step {step} as {asked} asks, "
                                    f"although {unstable}. Adam's steps may come out too small "
                                    "or too large after it.")
        if step >= self.ceiling:
            return True, self._warn(f"{name}: variance frozen after step {step}, the ceiling of "
                                    f"the hold, although {unstable}")
        if not self.held:
            self.held = True
            self._warn(f"{name}: {asked} is held: the variance is {unstable}. It goes on being "
                       f"updated until it is stable, after step {self.ceiling} at the latest. "
                       f"Pass hold_until_stable=False to freeze at step {self.requested} anyway.")
        return False, ""

    def _warn(self, message: str) -> str:
        warnings.warn(message, RuntimeWarning, stacklevel=6)  # the caller of step()
        return message

    def _freeze(self, step: int, message: str) -> None:
        self.frozen_at, self.reason = step, message
        if self._rank() in (None, 0):
            log.info(message)
        for group in self.optimizer.param_groups:  # the snapshots are only needed until now
            for p in group["params"]:
                self.optimizer.state[p].pop(_SNAPSHOT_KEY, None)

    # -- the measure ---------------------------------------------------------------------------

    def _maybe_measure(self, buckets: list, step: int, variance_updates: int) -> None:
        if self.snapshot_step is None:
            if step >= FLOOR - WINDOW:
                self._snapshot(buckets, step, variance_updates)
            return
        if step - self.snapshot_step < WINDOW:
            return
        self.last = self._measure(buckets, step, variance_updates)
        if self._rank() in (None, 0):
            log.debug("%s: %s", type(self.optimizer).__name__, self.last.describe())
        self._snapshot(buckets, step, variance_updates)

    def _snapshot(self, buckets: list, step: int, variance_updates: int) -> None:
        state = self.optimizer.state
        for bucket in buckets:
            for p, d in zip(bucket.params, self.optimizer._denominators(bucket, variance_updates)):
                state[p][_SNAPSHOT_KEY] = d
        self.snapshot_step = step

    def _measure(self, buckets: list, step: int, variance_updates: int) -> Measure:
        """The rate of the group where it is largest against its threshold; each group's rate is
        the largest over ranks (they hold the same variance: the maximum makes them decide alike)."""
        groups = self.optimizer.param_groups
        index = {id(g): i for i, g in enumerate(groups)}
        device = buckets[0].params[0].device if buckets else torch.device("cpu")
        totals = torch.zeros(2, len(groups), dtype=torch.float64, device=device)  # changes, counts
        state = self.optimizer.state
        for bucket in buckets:
            now = self.optimizer._denominators(bucket, variance_updates)
            for g, indices in bucket.group_indices:
                for i in indices:
                    p = bucket.params[i]
                    has_variance = state[p]["exp_avg_sq"] > 0
                    before = state[p][_SNAPSHOT_KEY]
                    relative = ((now[i] - before).abs() / before).clamp_(max=1.0)
                    totals[0, index[id(g)]] += torch.where(has_variance, relative, 0).sum().to(device)
                    totals[1, index[id(g)]] += has_variance.sum().to(device)
        rates = torch.where(totals[1] > 0, totals[0] / totals[1].clamp(min=1), math.inf)
        rates = self._max_over_ranks(rates / (step - self.snapshot_step)).tolist()
        thresholds = [1 - g["betas"][1] for g in groups]
        worst = max(range(len(groups)), key=lambda i: rates[i] / max(thresholds[i], 1e-12))
        return Measure(self.snapshot_step, step, rates[worst], thresholds[worst])

    def _max_over_ranks(self, rates: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(rates, op=dist.ReduceOp.MAX, group=self.optimizer.group)
        return rates

    def _rank(self):
        return self.optimizer._rank_identity()[0]

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"snapshot_step": self.snapshot_step, "last": asdict(self.last) if self.last else None,
                "held": self.held, "frozen_at": self.frozen_at, "reason": self.reason}

    def load_state_dict(self, saved: dict) -> None:
        self.snapshot_step = saved.get("snapshot_step")
        self.last = Measure(**saved["last"]) if saved.get("last") else None
        self.held = bool(saved.get("held", False))
        self.frozen_at = saved.get("frozen_at")
        self.reason = saved.get("reason", "")
