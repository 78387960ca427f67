"""0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via 0/1
Adam"), with the schedules of DeepSpeed's removed ``ZeroOneAdam``.

Where 1-bit Adam needs a warm-up of exact communication until its variance freezes, 0/1 Adam
compresses from the start in the paper; here after ``warmup_steps`` exact steps (64 by default):

- **until the variance freezes** (``var_freeze_step="auto"``: when it is measured stable, on its
  variance steps, as ``OneBitAdam``'s; an explicit step that comes earlier is held until then,
  ``ciuicflow.optim.variance_freeze``): the variance is updated only on *variance steps*, whose gradients
  are averaged exactly; on every other step each rank folds its own gradients into the momentum and
  the ranks average the update directions ``m / (sqrt(v_hat) + eps)`` with ciuicflow's 1-bit
  all-reduce (worker and server error feedback; worker only where two nodes exchange), as
  ``OneBitAdam`` after its warm-up. (The paper averages the gradients with 1 bit and folds them into
  the momentum after: ``compress_before_freeze="gradients"``; it lost more accuracy here.) Variance
  steps start every step and thin out: after ``var_update_scaler`` of them the interval doubles.
- **after it** (variance frozen): *local steps*. Each rank moves its parameters with its own
  momentum; every ``local_step_interval`` steps the ranks average how far they moved since the
  last sync with the 1-bit all-reduce, all move that far from where they last agreed, and rebuild
  the momentum from it. No communication between those steps. The interval doubles every
  ``local_step_scaler`` steps, up to ``local_step_clipper``.

As in ``OneBitAdam``, what is compressed after the freeze is in the update's unit scale (the mean
update direction ``m_hat / (sqrt(v_hat) + eps)`` over the period, not momentum), elements whose
variance is 0 are kept at 0, weight decay is decoupled, and everything runs without DDP, or in
DeepSpeed's engine, which then all-reduces exactly the variance steps' gradients
(``add_exact_step_listener``). At a sync every rank restarts from the parameters of the last sync
(kept in ``synced_params``) rather than undoing its local steps, so ranks agree bit for bit; a
period of one step (every step, until ``local_step_scaler`` steps) is ``OneBitAdam``'s step.
"""
from __future__ import annotations

import torch

from ciuicflow.compression.onebit import DEFAULT_CHUNK_SIZE
from ciuicflow.compression.quantized import QuantizedErrors
from ciuicflow.optim.compressed_momentum import CompressedMomentumOptimizer, _check_adam_args, _FlatBucket
from ciuicflow.optim.variance_freeze import AUTO, VarianceFreeze

COMPRESS_BEFORE_FREEZE = ("directions", "gradients")
# exact steps first: 1-bit directions from the start cost accuracy on six nodes, where 64 exact steps
# brought it back (docs/onebit_adam.md, "0/1 Adam's warm-up")
DEFAULT_WARMUP_STEPS = 64


class ZeroOneAdam(CompressedMomentumOptimizer):
    """0/1 Adam: 1-bit averages of the update direction with sparse exact variance updates, then
    local steps synchronised by 1-bit averages of the parameters' moves.

    Args:
        params, lr, betas, eps, weight_decay, bias_correction, group, hierarchical, chunk_size,
            caller_averages_grads: as in ``OneBitAdam``.
        var_freeze_step: ``"auto"`` (default): the variance freezes after the first variance
            step at which it is measured stable, as ``OneBitAdam``'s ``freeze_steps``; an integer:
            after this step if it is stable by then, else see ``hold_until_stable``.
        hold_until_stable: as in ``OneBitAdam``: an explicit ``var_freeze_step`` before the
            variance is stable warns and keeps the variance steps going until it is (True), or
            warns and freezes anyway (False).
        warmup_steps: the first steps (up to ``var_freeze_step``) are all variance steps, Adam on
            the exact mean gradient; the variance steps' schedule runs alongside as without them.
            Not in the paper (0 gives its algorithm): compressing from the start cost accuracy on
            six nodes (a small LM, seeds 0/1: +3.2% / +2.2% above AdamW; with 64 exact steps first
            +0.2% / +1.2%, docs/onebit_adam.md, "0/1 Adam's warm-up").
        compress_before_freeze: what the steps between variance steps average with 1 bit:
            ``"directions"`` (default) each rank's momentum folded with its own gradient, as update
            directions ``m / (sqrt(v_hat) + eps)`` (``OneBitAdam``'s step, with the variance of the
            last variance step); ``"gradients"`` the gradients, folded into the momentum after (the
            paper's and DeepSpeed's algorithm; it ended 3.3% above Adam on a held-out LM task, where
            ``"directions"`` ended 1.2% above: docs/onebit_adam.md).
        var_update_scaler: variance steps before their interval doubles.
        local_step_scaler: steps after the freeze before the local-step interval doubles.
        local_step_clipper: the largest local-step interval.
    """

    flat_state_keys = ("exp_avg", "synced_params")  # synced_params: where all ranks last agreed

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, var_freeze_step: int | str = AUTO,
                 hold_until_stable: bool = True,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, var_update_scaler: int = 16,
                 local_step_scaler: int = 32_678,
                 local_step_clipper: int = 16, bias_correction: bool = True, group=None,
                 hierarchical: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 caller_averages_grads: bool = False, compress_before_freeze: str = "directions"):
        _check_adam_args(lr, betas, eps, weight_decay)
        if compress_before_freeze not in COMPRESS_BEFORE_FREEZE:
            raise ValueError(f"compress_before_freeze must be one of {COMPRESS_BEFORE_FREEZE}, "
                             f"got {compress_before_freeze!r}")
        self.compress_before_freeze = compress_before_freeze
        for name, value in (("var_update_scaler", var_update_scaler),
                            ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps}")
        self.warmup_steps = int(warmup_steps)
        self.var_update_scaler = int(var_update_scaler)
        self.local_step_scaler = int(local_step_scaler)
        self.local_step_clipper = int(local_step_clipper)
        # the schedules (saved with the state)
        self.var_interval, self.var_counter, self.variance_updates = 1, 0, 0
        self.local_step_interval, self.local_step_counter, self.steps_since_sync = 1, 0, 0
        # per group, over the local steps since the last sync: lr summed, (1 - lr * wd) multiplied
        self.lr_sums: list | None = None
        self.decay_products: list | None = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, group=group, hierarchical=hierarchical,
                         chunk_size=chunk_size, caller_averages_grads=caller_averages_grads)
        self.variance_freeze = VarianceFreeze(self, "var_freeze_step", var_freeze_step,
                                              hold_until_stable)
        self.var_freeze_step = self.variance_freeze.requested

    # -- the schedules ------------------------------------------------------------------------

    def _next_step_exact(self) -> bool:
        return not self.frozen and self._variance_step_at(self.steps_taken + 1)

    def _variance_step_at(self, t: int) -> bool:
        return t <= self.warmup_steps or t % self.var_interval == 0

    def _schedule_state(self) -> dict:
        return {"var_interval": self.var_interval, "var_counter": self.var_counter,
                "variance_updates": self.variance_updates,
                "local_step_interval": self.local_step_interval,
                "local_step_counter": self.local_step_counter,
                "steps_since_sync": self.steps_since_sync, "lr_sums": self.lr_sums,
                "decay_products": self.decay_products, "freeze": self.variance_freeze.state_dict()}

    def _load_schedule_state(self, schedule: dict) -> None:
        self.variance_freeze.load_state_dict(schedule.get("freeze", {}))
        for key in self._schedule_state():
            if key != "freeze":
                value = schedule[key]
                setattr(self, key, list(value) if isinstance(value, list) else value)

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss, buckets = self._begin_step(closure)
        if buckets is None:
            return loss
        t = self.steps_taken
        if self.frozen:
            for i, g in enumerate(self.param_groups):
                self.lr_sums[i] += g["lr"]
                self.decay_products[i] *= 1 - g["lr"] * g["weight_decay"]
            sync = t % self.local_step_interval == 0
            for bucket in buckets:
                self._local_step(bucket, sync)
            self.steps_since_sync = 0 if sync else self.steps_since_sync + 1
            if sync:
                self._restart_sums()
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)
        else:
            variance_step = self._variance_step_at(t)
            if variance_step:
                self.variance_updates += 1
            for bucket in buckets:
                if variance_step:
                    self._variance_step(bucket)
                else:
                    self._compressed_step(bucket)
            if t % self.var_interval == 0:  # the schedule's own, warm-up or not
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
            if self.variance_freeze.after_step(buckets, t, variance_step, self.variance_updates):
                if self.compress_before_freeze == "gradients":
                    for bucket in buckets:
                        bucket.errors = QuantizedErrors()  # they held gradients; from now on, directions
                self.steps_since_sync = 0
                self._restart_sums()
                self._set_frozen(True)
                return loss
        self._notify_exact_step()
        return loss

    def _variance_step(self, bucket: _FlatBucket) -> None:
        grads = self._mean_grads(bucket)
        self._fold_into_momentum(bucket, grads)
        self._fold_into_variance(bucket, grads)
        bucket.cache.clear()  # derived from the variance
        self._apply(bucket, self._directions(bucket, self._cached_denominators(bucket)))

    def _compressed_step(self, bucket: _FlatBucket) -> None:
        """A step between variance steps: 1-bit communication only."""
        if self.compress_before_freeze == "gradients":
            self._compressed_gradient_step(bucket)
            return
        # the momentum is in step on every rank; each folds its own gradients into it and the ranks
        # average the resulting directions with 1 bit, as OneBitAdam after its warm-up. Gradients
        # compressed into the momentum (the paper) lost more: 1-bit noise enters a momentum that only
        # the next compressed gradients correct, and Adam's update, divided by a variance that 1-bit
        # noise does not enter here, moved less far along the exact direction
        self._fold_into_momentum(bucket, self._grads(bucket))
        self._step_with_average_direction(bucket, self._cached_denominators(bucket))

    def _compressed_gradient_step(self, bucket: _FlatBucket) -> None:
        # the gradients themselves, as the paper: dividing them by sqrt(v_hat) first, as OneBitAdam
        # does with its momentum, converged a little worse (digits, variance frozen at 20%, 4 seeds:
        # +1.0% to +2.2% above Adam, against +1.0% to +1.9%): v still moves on variance steps, and
        # the error feedback spans them
        flat = torch.cat([g.reshape(-1) for g in self._grads(bucket)]).to(bucket.params[0].dtype)
        self._compressed_average(bucket, flat)
        grads = bucket.views(flat)
        self._zero_where_no_variance(bucket, grads)
        self._fold_into_momentum(bucket, grads)
        self._apply(bucket, self._directions(bucket, self._cached_denominators(bucket)))

    def _local_step(self, bucket: _FlatBucket, sync: bool) -> None:
        self._fold_into_momentum(bucket, self._grads(bucket))
        denominators = self._cached_denominators(bucket)
        period_start = self.steps_since_sync == 0  # the parameters agree on every rank now
        if sync and period_start:  # a period of one step: OneBitAdam's step
            self._step_with_average_direction(bucket, denominators)
            return
        anchors = [self.state[p]["synced_params"] for p in bucket.params]
        if period_start:
            torch._foreach_copy_(anchors, bucket.params)
        self._apply(bucket, self._directions(bucket, denominators))
        if sync:
            self._sync(bucket, anchors, denominators)

    def _sync(self, bucket: _FlatBucket, anchors: list, denominators: list) -> None:
        """Average how far the ranks moved since the last sync, as the mean update direction
        (decay^k * p_sync - p) * (1 - b1^t) / sum(lr), in the same units as a period of one step;
        every rank then lands on decay^k * p_sync - sum(lr) / (1 - b1^t) * average, bit for bit,
        and keeps average * denominator as its momentum."""
        params = bucket.params
        moved_flat = torch.empty_like(bucket.flats["synced_params"])
        moved = bucket.views(moved_flat)
        torch._foreach_copy_(moved, anchors)
        periods = list(self._since_sync(bucket))
        for g, indices, lr_sum, decay in periods:
            if decay != 1.0:
                torch._foreach_mul_([moved[i] for i in indices], decay)
        torch._foreach_sub_(moved, params)
        for g, indices, lr_sum, decay in periods:
            torch._foreach_mul_([moved[i] for i in indices], self._momentum_correction(g) / lr_sum)
        self._compressed_average(bucket, moved_flat)
        self._zero_where_no_variance(bucket, moved)
        torch._foreach_copy_(params, anchors)
        for g, indices, lr_sum, decay in periods:
            if decay != 1.0:
                torch._foreach_mul_([params[i] for i in indices], decay)
            torch._foreach_add_([params[i] for i in indices], [moved[i] for i in indices],
                                alpha=-lr_sum / self._momentum_correction(g))
        torch._foreach_copy_(self._momenta(bucket), torch._foreach_mul(moved, denominators))

    def _since_sync(self, bucket: _FlatBucket):
        """(group, its indices in the bucket, lr summed and weight decay multiplied since the last
        sync) for the bucket's groups."""
        index = {id(g): i for i, g in enumerate(self.param_groups)}
        for g, indices in bucket.group_indices:
            i = index[id(g)]
            yield g, indices, self.lr_sums[i], self.decay_products[i]

    def _restart_sums(self) -> None:
        self.lr_sums = [0.0] * len(self.param_groups)
        self.decay_products = [1.0] * len(self.param_groups)

    def _cached_denominators(self, bucket: _FlatBucket) -> list:
        """The variance changes only on variance steps (which clear the cache)."""
        if "denominators" not in bucket.cache:
            bucket.cache["denominators"] = self._denominators(bucket, self.variance_updates)
        return bucket.cache["denominators"]
