"""1-bit Adam (Tang et al. 2021): Adam whose momentum, not its gradient, crosses the network in 1 bit.

Until its variance is stable it is plain Adam on the exact mean gradient: by default until the
variance is measured to be stable (``freeze_steps="auto"``, ``ciuicflow.optim.variance_freeze``);
an explicit ``freeze_steps`` that comes earlier is held, with a warning, until it is. The variance
is then frozen; from then on each rank folds its *local* gradient into its
momentum, and the momenta are averaged by ciuicflow's 1-bit all-reduce with worker and server error
feedback (worker only where the exchange has two ranks, e.g. two nodes, as the hooks)
(``ciuicflow.compression.onebit``: across nodes only, after an exact intra-node
reduce-scatter, when ``hierarchical``; over all traffic otherwise). The averaged momentum is the same
bit for bit on every rank, so parameters stay in sync without sending gradients.

    optimizer = OneBitAdam(model.parameters(), lr=1e-3)  # freezes when the variance is stable
    for batch in loader:                       # no DDP: the optimizer does the communication
        loss_fn(model(batch)).backward()
        optimizer.step()
        optimizer.zero_grad()

Every rank must call ``step`` together (it is collective) and start from the same parameters.
During warm-up ``step`` averages the gradients itself; inside DeepSpeed's engine the engine does
that (``caller_averages_grads``), and stops after warm-up (see
``ciuicflow.integrations.deepspeed``, installed automatically when deepspeed is imported).

State: ``exp_avg`` / ``exp_avg_sq`` per parameter (``exp_avg`` is a view into one flat buffer per
device and dtype, the buffer the collective reduces), and in ``state_dict()["onebit"]`` the step
count, whether and when the variance froze (and the freeze measure's window), and this rank's
error-feedback buffers. Each rank saves and
loads its own ``state_dict``; errors saved by another rank, or for another world size, are dropped
with a warning (the run still converges, it just does not continue bit for bit).

A parameter group with ``compress=False`` has its momentum averaged exactly, in the same two
collectives (for tensors whose momentum must not pick up compression noise, e.g. ones that stay
exactly zero).
"""
from __future__ import annotations

import torch

from ciuicflow.compression.onebit import DEFAULT_CHUNK_SIZE
from ciuicflow.optim.compressed_momentum import CompressedMomentumOptimizer, _check_adam_args, \
    _FlatBucket
from ciuicflow.optim.variance_freeze import AUTO, VarianceFreeze


class OneBitAdam(CompressedMomentumOptimizer):
    """1-bit Adam: Adam on the exact mean gradient until the variance is stable, then a frozen
    variance and a momentum averaged with 1-bit compression and error feedback.

    Args:
        params: parameters or parameter groups (a group may set ``compress=False``: its momentum
            is averaged exactly).
        lr, betas, eps: as in ``torch.optim.Adam``.
        weight_decay: decoupled, as in AdamW (``p -= lr * weight_decay * p``).
        freeze_steps: ``"auto"`` (default): freeze after the first step at which the variance is
            measured stable (``variance_freeze``: its preconditioner moves less than ``1 - beta2``
            per step over 20 steps; not before step 40, at the latest after ``10 / (1 - beta2)``).
            An integer N >= 1: freeze after step N if the variance is stable by then, else see
            ``hold_until_stable``. ``frozen_at`` and ``freeze_reason`` say when and why.
        hold_until_stable: when an explicit ``freeze_steps`` comes before the variance is stable:
            warn and keep exact Adam until it is (True, default), or warn and freeze at
            ``freeze_steps`` anyway (False).
        bias_correction: Adam's bias correction (the paper's algorithm has none: pass False).
        scale_momentum_before_compress: compress ``m / (sqrt(v_hat) + eps)``, the update
            direction, instead of ``m``. The frozen variance is the same on every rank, so the
            average is the same in exact arithmetic; but 1-bit keeps one scale per chunk, and
            the update's elements are all of Adam's unit size where the momentum's differ by
            orders of magnitude, so the compression noise no longer lands, divided by a tiny
            variance, on rarely-updated elements (the paper compresses ``m``: pass False).
        group: the process group (default: the world).
        hierarchical: compress only inter-node traffic, after an exact intra-node reduce-scatter
            (True), or all traffic (False).
        chunk_size: elements per 1-bit scale (a multiple of 8).
        caller_averages_grads: during warm-up the gradients arrive averaged (True when a wrapper,
            such as DeepSpeed's engine, averages them; the DeepSpeed integration sets it).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_steps: int | str = AUTO,
                 hold_until_stable: bool = True, bias_correction: bool = True,
                 scale_momentum_before_compress: bool = True, group=None, hierarchical: bool = True,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, caller_averages_grads: bool = False):
        _check_adam_args(lr, betas, eps, weight_decay)
        self.scale_momentum_before_compress = bool(scale_momentum_before_compress)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, group=group, hierarchical=hierarchical,
                         chunk_size=chunk_size, caller_averages_grads=caller_averages_grads)
        self.variance_freeze = VarianceFreeze(self, "freeze_steps", freeze_steps, hold_until_stable)
        self.freeze_steps = self.variance_freeze.requested

    @torch.no_grad()
    def step(self, closure=None):
        loss, buckets = self._begin_step(closure)
        if buckets is None:
            return loss
        for bucket in buckets:
            if self.frozen:
                self._compressed_step(bucket)
            else:
                self._warmup_step(bucket)
        if not self.frozen and self.variance_freeze.after_step(buckets, self.steps_taken, True,
                                                               self.steps_taken):
            self._set_frozen(True)
        return loss

    def _warmup_step(self, bucket: _FlatBucket) -> None:
        grads = self._mean_grads(bucket)
        self._fold_into_momentum(bucket, grads)
        self._fold_into_variance(bucket, grads)
        # exact Adam: never past the bound, and zero where the variance is (no per-tensor mask, which
        # on a GPU would cost a host sync per tensor per step; the cache stays empty until the freeze)
        denominators = self._denominators(bucket, self.steps_taken)
        self._apply(bucket, self._directions(bucket, denominators, bounded=False))

    def _compressed_step(self, bucket: _FlatBucket) -> None:
        self._fold_into_momentum(bucket, self._grads(bucket))
        if "denominators" not in bucket.cache:  # the variance is frozen: computed once
            bucket.cache["denominators"] = self._denominators(bucket, self._frozen_variance_updates())
        denominators = bucket.cache["denominators"]
        momenta = self._momenta(bucket)
        if not self.scale_momentum_before_compress:
            self._compressed_average(bucket, bucket.flats["exp_avg"])
            self._zero_where_no_variance(bucket, momenta)
            self._apply(bucket, self._directions(bucket, denominators))
            return
        self._step_with_average_direction(bucket, denominators)

    def _frozen_variance_updates(self) -> int:
        frozen_at = self.variance_freeze.frozen_at
        if frozen_at is None:  # a state saved before the freeze step was recorded
            frozen_at = self.freeze_steps if self.freeze_steps != AUTO else self.steps_taken
        return frozen_at

    def _schedule_state(self) -> dict:
        return {"freeze": self.variance_freeze.state_dict()}

    def _load_schedule_state(self, schedule: dict) -> None:
        self.variance_freeze.load_state_dict(schedule.get("freeze", {}))

    def _error_layout(self) -> dict:
        return dict(super()._error_layout(), scaled=self.scale_momentum_before_compress)
