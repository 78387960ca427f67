"""What the 1-bit Adam family shares: flat momentum buffers, their error feedback, the exact and the
1-bit averages, the exact-step listeners an engine follows, the variance freeze and the rank-local
state dict (``OneBitAdam`` and ``ZeroOneAdam`` build on it)."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ciuicflow.collectives.hierarchical import flat_all_reduce, hierarchical_all_reduce
from ciuicflow.collectives.primitives import Traffic
from ciuicflow.compression.onebit import DEFAULT_CHUNK_SIZE, OneBitCompressor
from ciuicflow.compression.quantized import QuantizedErrors, quantized_all_reduce
from ciuicflow.optim.engines import prepare_engines
from ciuicflow.topology import Topology

_STATE_KEY = "onebit"
_STATE_VERSION = 1


@dataclass
class _FlatBucket:
    """The parameters of one device and dtype, laid end to end: flat buffers (by state key) whose
    views are the parameters' state (``exp_avg``, ...), and the positions averaged exactly."""

    params: list
    flats: dict  # state key -> flat buffer
    exact_mask: torch.Tensor | None
    group_indices: list  # (param group, indices into params of its members)
    errors: QuantizedErrors = field(default_factory=QuantizedErrors)
    cache: dict = field(default_factory=dict)  # derived from the state; rebuilt after a load

    def views(self, flat: torch.Tensor) -> list:
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out


class CompressedMomentumOptimizer(Optimizer):
    """What the 1-bit Adam family shares: flat per-parameter state buffers and their error
    feedback, the exact gradient average, the 1-bit average, the exact-step listeners an engine
    follows, the variance freeze, and the rank-local part of the state dict. Subclasses write
    ``step`` (and, when some steps need exact gradients besides the warm-up, ``_next_step_exact``)."""

    quiet_foreign_errors = False  # set while an engine loads rank 0's state dict on every rank
    flat_state_keys = ("exp_avg",)  # per-parameter state kept as views of one flat buffer

    def __init__(self, params, defaults: dict, *, group=None, hierarchical: bool = True,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, caller_averages_grads: bool = False):
        if chunk_size <= 0 or chunk_size % 8:
            raise ValueError(f"chunk_size must be a positive multiple of 8, got {chunk_size}")
        super().__init__(params, dict(defaults, compress=True))
        for g in self.param_groups:
            for p in g["params"]:
                if p.is_complex() or not p.is_floating_point():
                    raise TypeError(f"{type(self).__name__} needs floating-point real parameters, "
                                    f"got {p.dtype}")
        self.group = group
        self.hierarchical = bool(hierarchical)
        self.chunk_size = int(chunk_size)
        # 1-bit Adam's exchange: all of the error carried over, no accuracy guard; phases "auto":
        # one up to registry.ONE_PHASE_RANKS exchanging ranks, two beyond (the hooks' rule), whose
        # servers send 1 bit (server_codec="same"; the hooks' send int4): within the line on six
        # nodes (docs/onebit_adam.md). Plain scale x sign (outliers=0): the optimizers' results
        # were measured without values.
        self._compressor = OneBitCompressor(chunk_size=self.chunk_size, error_decay=1.0, phases="auto",
                                            guard="off", outliers=0, server_codec="same")
        self.caller_averages_grads = bool(caller_averages_grads)
        self.traffic = Traffic()  # modelled bytes sent by this rank, warm-up and compressed
        self.steps_taken = 0
        self.frozen = False
        self._buckets: list[_FlatBucket] | None = None
        self._topology: Topology | None = None
        self._loaded_errors: list | None = None
        self._exact_step_listeners: list = []
        self._skip_next_steps = 0  # DeepSpeed's state-allocating step (see integrations.deepspeed)
        prepare_engines()  # deepspeed.initialize must know how to drive us

    @property
    def frozen_at(self) -> int | None:
        """The step after which the variance froze (None before; a subclass's ``variance_freeze``)."""
        return self.variance_freeze.frozen_at

    @property
    def freeze_reason(self) -> str:
        return self.variance_freeze.reason

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_buckets", None) is not None or getattr(self, "steps_taken", 0):
            raise RuntimeError(f"{type(self).__name__}: add parameter groups before the first step "
                               "(the layout of the compressed buffers is fixed by then)")
        super().add_param_group(param_group)

    # -- what subclasses use ---------------------------------------------------------------

    def add_exact_step_listener(self, listener) -> None:
        """``listener(exact: bool)``: whether the next step needs exactly averaged gradients. Called
        now and whenever that changes (the warm-up ends, a state is loaded): an engine that averages
        gradients for us (``caller_averages_grads``) switches its all-reduce on and off with it."""
        self._exact_step_listeners.append(listener)
        listener(self._next_step_exact())

    def _next_step_exact(self) -> bool:
        return not self.frozen

    def _set_frozen(self, frozen: bool) -> None:
        self.frozen = frozen
        self._notify_exact_step()

    def _topo(self) -> Topology:
        if self._topology is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(f"{type(self).__name__}.step is collective: initialise "
                                   "torch.distributed (init_process_group) first")
            self._topology = Topology.detect(self.group)
        return self._topology

    def _flat_buckets(self) -> list[_FlatBucket]:
        """Build the momentum buffers on first use (and after a load), keeping any loaded momentum."""
        if self._buckets is not None:
            return self._buckets
        by_key: dict = {}
        for g in self.param_groups:
            for p in g["params"]:
                by_key.setdefault((p.device, p.dtype), []).append((p, g))
        buckets = []
        for (device, dtype), members in by_key.items():
            params = [p for p, _ in members]
            numel = sum(p.numel() for p in params)
            flats = {key: torch.zeros(numel, device=device, dtype=dtype) for key in self.flat_state_keys}
            exact = None
            if not all(g["compress"] for _, g in members):
                exact = torch.cat([torch.full((p.numel(),), not g["compress"], dtype=torch.bool,
                                              device=device) for p, g in members])
            group_indices = [(g, [i for i, (_, owner) in enumerate(members) if owner is g])
                             for g in self.param_groups]
            bucket = _FlatBucket(params, flats, exact, [(g, i) for g, i in group_indices if i])
            for key, flat in flats.items():
                for p, view in zip(params, bucket.views(flat)):
                    if key in self.state[p]:
                        view.copy_(self.state[p][key])
                    self.state[p][key] = view
            for p in params:
                self.state[p].setdefault("exp_avg_sq", torch.zeros_like(p))
            buckets.append(bucket)
        if self._loaded_errors is not None:
            for bucket, saved in zip(buckets, self._loaded_errors):
                bucket.errors.load_state_dict({k: v.to(bucket.params[0].device).clone()
                                               for k, v in saved.items()})
            self._loaded_errors = None
        self._buckets = buckets
        return buckets

    def _grads(self, bucket: _FlatBucket) -> list:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                grads.append(torch.zeros_like(p))  # every rank must send the same layout
            elif p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            else:
                grads.append(p.grad)
        return grads

    def _mean_grads(self, bucket: _FlatBucket) -> list:
        """The gradients of a step that needs them exact: averaged over the group here, or as they
        are when the caller (DeepSpeed's engine) has averaged them already."""
        grads = self._grads(bucket)
        if self.caller_averages_grads:
            return grads
        flat = torch.cat([g.reshape(-1) for g in grads]).to(bucket.params[0].dtype)
        reduce = hierarchical_all_reduce if self.hierarchical else flat_all_reduce
        reduce(flat, self._topo(), op="mean", traffic=self.traffic)
        return bucket.views(flat)

    def _compressed_average(self, bucket: _FlatBucket, flat: torch.Tensor) -> None:
        """Average ``flat`` (laid out as the bucket) in place: 1-bit with the bucket's errors."""
        quantized_all_reduce(self._compressor, flat, bucket.errors, self._topo(),
                             hierarchical=self.hierarchical, exact_mask=bucket.exact_mask,
                             traffic=self.traffic)

    def _notify_exact_step(self) -> None:
        for listener in self._exact_step_listeners:
            listener(self._next_step_exact())

    def _skip_step(self) -> bool:
        if self._skip_next_steps:
            self._skip_next_steps -= 1
            return True
        return False

    def _begin_step(self, closure):
        """What every step starts with: (the closure's loss, this step's buckets), with
        ``steps_taken`` counting this step; the buckets are None when the step is skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_step():
            return loss, None
        buckets = self._flat_buckets()
        self.steps_taken += 1
        return loss, buckets

    # -- Adam's arithmetic, on a bucket's parameters, group by group -------------------------

    def _momenta(self, bucket: _FlatBucket) -> list:
        return [self.state[p]["exp_avg"] for p in bucket.params]

    def _fold_into_momentum(self, bucket: _FlatBucket, grads: list) -> None:
        """m = b1 m + (1 - b1) g"""
        momenta = self._momenta(bucket)
        for g, indices in bucket.group_indices:
            torch._foreach_lerp_([momenta[i] for i in indices], [grads[i] for i in indices],
                                 1 - g["betas"][0])

    def _fold_into_variance(self, bucket: _FlatBucket, grads: list) -> None:
        """v = b2 v + (1 - b2) g^2"""
        variances = [self.state[p]["exp_avg_sq"] for p in bucket.params]
        for g, indices in bucket.group_indices:
            some = [grads[i] for i in indices]
            torch._foreach_mul_([variances[i] for i in indices], g["betas"][1])
            torch._foreach_addcmul_([variances[i] for i in indices], some, some,
                                    value=1 - g["betas"][1])

    def _denominators(self, bucket: _FlatBucket, variance_updates: int) -> list:
        """``sqrt(v_hat) + eps`` per parameter, v_hat corrected for ``variance_updates`` updates."""
        out = [None] * len(bucket.params)
        for g, indices in bucket.group_indices:
            scale = math.sqrt(1 - g["betas"][1] ** max(1, variance_updates)) \
                if g["bias_correction"] else 1.0
            denom = torch._foreach_sqrt([self.state[bucket.params[i]]["exp_avg_sq"] for i in indices])
            torch._foreach_div_(denom, scale)
            torch._foreach_add_(denom, g["eps"])
            for i, d in zip(indices, denom):
                out[i] = d
        return out

    def _momentum_correction(self, g: dict) -> float:
        return 1 - g["betas"][0] ** self.steps_taken if g["bias_correction"] else 1.0

    def _directions(self, bucket: _FlatBucket, denominators: list, bounded: bool = True) -> list:
        """``m / (sqrt(v_hat) + eps)`` per parameter, bounded unless the step is exact Adam's, which
        never reaches the bound (new tensors; m's bias correction is _apply's)."""
        directions = torch._foreach_div(self._momenta(bucket), denominators)
        if bounded:
            self._bound_directions(bucket, directions)
        return directions

    def _bound_directions(self, bucket: _FlatBucket, directions: list) -> None:
        """Clamp update directions, in place, to the largest ``|m / sqrt(v_hat)|`` exact Adam can
        reach with the group's betas (``adam_direction_bound``), and zero them where the variance
        is 0.

        Exact Adam never reaches the bound: its variance holds every gradient its momentum does.
        A variance frozen, or updated only on some steps, does not: a unit that had no gradient when
        the variance was last updated (a ReLU that revives) divides its new momentum by almost
        nothing. Unbounded, one such element set its 1-bit chunk's scale in the thousands and a CNN
        under Adam diverged (docs/onebit_adam.md, "Bounded directions")."""
        self._zero_where_no_variance(bucket, directions)
        for g, indices in bucket.group_indices:
            bound = adam_direction_bound(*g["betas"])
            if math.isfinite(bound):
                torch._foreach_clamp_min_([directions[i] for i in indices], -bound)
                torch._foreach_clamp_max_([directions[i] for i in indices], bound)

    def _apply(self, bucket: _FlatBucket, directions: list) -> None:
        """``p = (1 - lr wd) p - lr / (1 - b1^t) * direction``: Adam's step, decoupled decay."""
        for g, indices in bucket.group_indices:
            params = [bucket.params[i] for i in indices]
            if g["weight_decay"]:
                torch._foreach_mul_(params, 1 - g["lr"] * g["weight_decay"])
            torch._foreach_add_(params, [directions[i] for i in indices],
                                alpha=-g["lr"] / self._momentum_correction(g))

    def _step_with_average_direction(self, bucket: _FlatBucket, denominators: list) -> None:
        """Average the update directions ``m / denominator`` (1-bit, in place in the momentum
        buffer: they are all about 1 where momenta differ by orders of magnitude), step with the
        average, and keep ``average * denominator`` as the momentum. With parameters that agree
        before, they agree after, bit for bit."""
        momenta = self._momenta(bucket)
        torch._foreach_div_(momenta, denominators)
        self._bound_directions(bucket, momenta)  # before the 1-bit chunks take their scales
        self._compressed_average(bucket, bucket.flats["exp_avg"])
        self._zero_where_no_variance(bucket, momenta)
        self._apply(bucket, momenta)
        torch._foreach_mul_(momenta, denominators)

    def _zero_where_no_variance(self, bucket: _FlatBucket, values: list) -> None:
        """Elements whose variance is 0 never had a gradient. A 1-bit value is never 0, and divided
        by a zero variance its noise would blow up: keep them at 0 (DeepSpeed's ``exp_avg_mask``,
        found here from the variance; cached until the variance changes)."""
        if "no_variance" not in bucket.cache:
            masks = [(self.state[p]["exp_avg_sq"] > 0).to(p.dtype) for p in bucket.params]
            bucket.cache["no_variance"] = [(i, m) for i, m in enumerate(masks) if not bool(m.all())]
        pairs = bucket.cache["no_variance"]
        if pairs:
            torch._foreach_mul_([values[i] for i, _ in pairs], [m for _, m in pairs])

    # -- state dict ------------------------------------------------------------------------

    def _rank_identity(self) -> tuple:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group), dist.get_world_size(self.group)
        return None, None

    def rank_state_dict(self) -> dict:
        """The rank-local part of the state (``state_dict()["onebit"]``): step count, freeze flag,
        this rank's error-feedback buffers (copies), and whose they are."""
        rank, world = self._rank_identity()
        if self._buckets is not None:
            errors = [{k: v.clone() for k, v in b.errors.state_dict().items()}
                      for b in self._buckets if b.errors.worker is not None]
            errors = errors if len(errors) == len(self._buckets) else []
        else:
            errors = self._loaded_errors or []
        return {"version": _STATE_VERSION, "optimizer": type(self).__name__,
                "steps_taken": self.steps_taken, "frozen": self.frozen,
                "rank": rank, "world_size": world, "layout": self._error_layout(), "errors": errors,
                "schedule": self._schedule_state()}

    def _schedule_state(self) -> dict:
        """Subclasses' step-dependent scalars (intervals, counters) to save with the state."""
        return {}

    def _load_schedule_state(self, schedule: dict) -> None:
        pass

    def _error_layout(self) -> dict:
        """What the meaning of the error buffers depends on, besides the rank."""
        return {"hierarchical": self.hierarchical, "chunk_size": self.chunk_size}

    def state_dict(self) -> dict:
        state = super().state_dict()
        state[_STATE_KEY] = self.rank_state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_KEY, None)
        if extra is None:
            raise ValueError(f"not a {type(self).__name__} state dict: it has no {_STATE_KEY!r} entry")
        self._check_owner(extra)
        super().load_state_dict(state_dict)
        self._buckets = None  # rebuilt from the loaded exp_avg at the next step
        self.steps_taken = int(extra["steps_taken"])
        self._load_schedule_state(extra.get("schedule", {}))
        self._loaded_errors = self._usable_errors(extra) or None
        self._set_frozen(bool(extra["frozen"]))

    def load_rank_state(self, extra: dict) -> None:
        """Load only the rank-local part (``rank_state_dict()``), e.g. after an engine loaded rank
        0's state dict on every rank."""
        self._check_owner(extra)
        self.steps_taken = int(extra["steps_taken"])
        self._load_schedule_state(extra.get("schedule", {}))
        errors = self._usable_errors(extra, quiet=False)
        self._buckets = None
        self._loaded_errors = errors or None
        self._set_frozen(bool(extra["frozen"]))

    def _check_owner(self, extra: dict) -> None:
        if extra.get("optimizer") != type(self).__name__:
            raise ValueError(f"this state was saved by {extra.get('optimizer')}, not by "
                             f"{type(self).__name__}")

    def _usable_errors(self, extra: dict, quiet: bool | None = None) -> list:
        quiet = self.quiet_foreign_errors if quiet is None else quiet
        rank, world = self._rank_identity()
        saved = (extra["rank"], extra["world_size"], extra.get("layout"))
        here = (rank, world, self._error_layout())
        if extra["errors"] and saved == here:
            return extra["errors"]
        if extra["errors"] and not quiet:
            warnings.warn(
                f"{type(self).__name__}: the loaded error-feedback buffers belong to rank "
                f"{saved[0]} of {saved[1]} with {saved[2]}; this is rank {rank} of {world} with "
                f"{here[2]}. They are reset to zero: training continues, but not bit for bit. "
                "Save and load each rank's own state_dict to resume exactly.",
                RuntimeWarning, stacklevel=3)
        return []


def adam_direction_bound(beta1: float, beta2: float) -> float:
    """The largest ``|m / sqrt(v_hat)|`` exact Adam reaches: by Cauchy-Schwarz over the gradients
    both averages hold, ``(1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))`` (7.27 for 0.9, 0.999; the
    bias corrections only lower it); unbounded when ``b1^2 >= b2``."""
    ratio = beta1 * beta1 / beta2 if beta2 > 0 else math.inf
    if ratio >= 1:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - ratio))


def _check_adam_args(lr, betas, eps, weight_decay) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"invalid epsilon: {eps}")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"invalid weight_decay: {weight_decay}")
