"""What every compressor is: options, a memory per tensor, and an exchange over a route.

A compressor averages a 1-D tensor in place over a ``Route`` (``ciuicflow.collectives.routes``):
``exchange(flat, memory, route, context, traffic)``. It keeps what it owes from one call to the
next (error feedback, warm start) in a memory object, one per tensor layout, made by
``new_memory()``. The glue around it (DDP hooks, FSDP, the 1-bit optimizers) owns the memories,
decides when to compress (warm-up) and which positions stay exact; the compressor owns the math.

The accuracy guard is shared: a compressor's memory reports ``relative_error``, ||memory|| over
the running mean of ||gradient|| (``update_guard``), and the glue warns or asks for an exact step
when it passes ``guard_threshold``: with ``guard="exact"`` the next step sends exactly what it
would have compressed (the input plus the memory, decayed as a compressed step adds it) in
float32, with ``guard="fp16"`` in float16 (half the bytes), the rounding owed in turn
(``guard_payload``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import ClassVar

import torch

from ciuicflow.collectives.routes import EXACT

GUARDS = ("warn", "exact", "fp16", "off")
_FP16_MAX = torch.finfo(torch.float16).max
GUARD_EMA = 0.9  # the gradient norm the guard divides by is a running mean over about 10 steps


@dataclass(frozen=True)
class Context:
    """What the glue knows about the tensor being exchanged.

    ``segments``: (offset, shape) of each parameter laid out in it (PowerSGD's matrices);
    ``exact_mask``: bool, True where positions must be averaged exactly (or None); ``step`` and
    ``key`` (the bucket's index) with ``seed`` seed anything random, the same on every rank;
    ``adaptive``: an adaptive optimizer (Adam, ...) steps these parameters
    (``compression.optimizer_watch``), which a compressor may answer with a more precise codec."""

    segments: tuple = ()
    exact_mask: torch.Tensor | None = None
    step: int = 0
    key: int = 0
    seed: int = 0
    adaptive: bool = False
    # a key under which the route may keep the result instead of writing it into the tensor
    # (``collectives.routes``: a DDP bucket's, whose hook returns whatever holds the mean)
    keep: object = None
    # what the optimizer divides each coordinate by (an adaptive one's root mean square, the
    # tensor's layout), so that the guard measures noise as the optimizer sees it (None: 1)
    units: torch.Tensor | None = None


class GuardedMemory:
    """The fields the accuracy guard keeps in a compressor's memory."""

    def __init__(self):
        self.relative_error: float | None = None
        self._guard_stale = False  # relative_error was measured before the guard's last exact step
        self._grad_norm_ema: float | None = None
        self.wire_plan = None  # what the last step sent (compression.policy.WirePlan), if planned
        self.rung, self.over = 0, 0  # its ladder: rungs climbed, steps in a row over the tolerance

    def sent_by_guard(self, traffic) -> None:
        """The guard's exact step sent what the memory held: it starts again from zero (the
        subclass's ``flush``), and the last measure (taken before) is stale until the next
        compressed step."""
        self.flush()
        self._guard_stale = True
        if traffic is not None:
            traffic.guard_exact_steps += 1


def update_guard(memory: GuardedMemory, error_norm: float, grad_norm: float) -> None:
    """The guard's measure: ||memory|| over the running mean of ||gradient||. The running mean,
    not this step's norm: near convergence, or where the learning rate decays to 0, gradients
    shrink faster than the memory drains, and dividing by the last one alone raised alarms on runs
    that kept exact accuracy."""
    ema = memory._grad_norm_ema
    ema = grad_norm if ema is None else GUARD_EMA * ema + (1 - GUARD_EMA) * grad_norm
    memory._grad_norm_ema = ema
    memory.relative_error = error_norm / ema if ema > 0 else 0.0
    memory._guard_stale = False


def guard_due(memory: GuardedMemory, threshold: float | None) -> bool:
    """Whether the guard asks for an exact step now (``threshold`` None: it never does)."""
    return threshold is not None and memory.relative_error is not None \
        and not memory._guard_stale and memory.relative_error > threshold


def guard_payload(total: torch.Tensor, world: int, half: bool):
    """What a rank sends in the guard's step, whose values are summed over ``world`` ranks:
    ``total`` (float32: its input plus all its memory owes) itself, or, with ``half``, in float16
    and clamped to 1/world of float16's range, so that the sum stays finite; and what that leaves
    owed, in ``total``'s units (None: nothing). inf/NaN stay as they are, for the callers'
    checks."""
    if not half:
        return total, None
    limit = _FP16_MAX / world
    clamped = total.clamp(-limit, limit)
    # clamp would make inf finite: keep it, so the sum shows it (and the step is skipped)
    sent = torch.where(torch.isinf(total), total, clamped).to(torch.float16)
    return sent, total - sent.to(torch.float32)


def exclude_mask(patterns, names, segments, numel: int, device) -> torch.Tensor | None:
    """True where a tensor laid out as ``segments`` ((offset, shape) per parameter, named
    ``names``) holds a parameter matching one of ``patterns`` (``fnmatch``); None if none does."""
    mask = torch.zeros(numel, dtype=torch.bool, device=device)
    for name, (offset, shape) in zip(names, segments):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            mask[offset:offset + torch.Size(shape).numel()] = True
    return mask if bool(mask.any()) else None


def snapshot(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy for a state_dict, of a buffer that later steps reuse and overwrite."""
    return None if tensor is None else tensor.detach().clone()


class Compressor:
    """Base of the compressors. A subclass sets ``name`` (the registry's key), ``option_names``
    (its constructor's keyword options, in order), ``layout_options`` (those a checkpoint's memory
    must match), and writes ``new_memory`` and ``exchange``.

    ``guard`` ("warn", "exact", "fp16" or "off") and ``guard_threshold`` are every compressing
    method's options; ``measure`` (computing the guard's norms) is on unless the guard is off."""

    name: ClassVar[str]
    option_names: ClassVar[tuple[str, ...]] = ()
    layout_options: ClassVar[tuple[str, ...]] = ()
    compresses: ClassVar[bool] = True
    guard: str = "off"
    guard_threshold: float | None = None

    def options(self) -> dict:
        return {name: getattr(self, name) for name in self.option_names}

    @property
    def measure(self) -> bool:
        return self.guard != "off"

    @property
    def exact_step_threshold(self) -> float | None:
        """The threshold past which the next step is the guard's exact step (guard "exact" or
        "fp16"), else None."""
        return self.guard_threshold if self.guard in ("exact", "fp16") else None

    @property
    def guard_half(self) -> bool:
        """The guard's exact step sends float16 (guard "fp16"), else float32."""
        return self.guard == "fp16"

    def new_memory(self):
        return None

    def route_for(self, route, hierarchical, device=None):
        """The route a tensor takes: ``route`` (the hook's), or ``hierarchical`` (the node sum,
        then an exchange between the nodes) where this compressor keeps accuracy only there."""
        return route

    def exchange(self, flat: torch.Tensor, memory, route, context: Context,
                 traffic) -> torch.Tensor | None:
        """Average ``flat`` (1-D, contiguous, floating point) in place over the route; return
        what holds the mean: ``flat`` (or None), or, with ``context.keep``, possibly a tensor the
        route keeps (``route.reduce``'s result)."""
        raise NotImplementedError

    def _set_guard(self, guard: str, threshold: float) -> None:
        if guard not in GUARDS:
            raise ValueError(f"guard must be one of {GUARDS}, got {guard!r}")
        if not float(threshold) > 0 or float(threshold) != float(threshold):
            raise ValueError(f"guard_threshold must be a positive number, got {threshold!r}")
        self.guard, self.guard_threshold = guard, float(threshold)


class ExactCompressor(Compressor):
    """No compression: an exact mean along the route (``hierarchical_allreduce``)."""

    name = "allreduce"
    compresses = False

    def exchange(self, flat, memory, route, context, traffic) -> torch.Tensor:
        return route.reduce(flat, EXACT, traffic, keep=context.keep)
