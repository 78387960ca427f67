"""Which parameters an adaptive optimizer (Adam, AdamW, RMSprop, ...) steps, learnt by watching.

1-bit error feedback is sound for optimizers whose update is linear in the gradient (SGD, with or
without momentum): what a step does not send is sent later, and the sum over steps is kept. An
adaptive optimizer divides every element by a running RMS of its own gradient, and the sign's
per-step noise enters that RMS while the late part of the signal arrives diluted: measured on
``bench/convergence``'s language models, Adam on 1-bit gradients moved 0.8 of the way exact
Adam did (the update direction's projection), which cost as much as training at 0.65x the
learning rate (docs/history/convergence-notebook.md). This is the reason 1-bit Adam compresses the momentum after a
frozen variance instead (``ciuicflow.OneBitAdam``).

A DDP hook sees gradients, not the optimizer, so the glue asks this watch: it registers torch's
global optimizer step pre-hook once per process and records the parameters that any optimizer
other than a linear one (``torch.optim.SGD``) steps. Every rank runs the same optimizer, so every
rank of an exchange reaches the same answer at the same step.
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Optimizers whose update is linear in the gradient: error feedback keeps their sum of updates.
LINEAR_OPTIMIZERS: tuple[type, ...] = (torch.optim.SGD,)

_lock = threading.Lock()
_adaptive: set[int] = set()  # ids of parameters; a parameter's id leaves when it is freed
_stepped_by: dict = {}  # id of an adaptively stepped parameter -> weakref of its optimizer
# where an adaptive optimizer keeps each coordinate's running mean square (what it divides by)
SECOND_MOMENT_KEYS = ("exp_avg_sq", "square_avg", "sum")
# The least unit a coordinate gets, as a share of its parameter's mean unit. A coordinate whose
# running mean square is still about 0 (an embedding row, an expert or a unit not yet reached)
# is not divided by that 0 once its gradient arrives: the gradient enters the mean square first,
# and about sqrt(1 - beta2) of its size is what Adam divides it by (0.03 at the default beta2,
# 0.999). Unfloored, one such coordinate would set its chunk's scale and round the rest away.
UNIT_FLOOR = 0.03
_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> params counted
_handle = None


def is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """True unless the optimizer is one whose update is linear in the gradient (SGD); an unknown
    optimizer counts as adaptive (the safe answer: it gets the more precise codec). A wrapper that
    builds its inner optimizer from a class (``ZeroRedundancyOptimizer``) is judged by that class."""
    inner = getattr(optimizer, "_optim_constructor", None)
    if isinstance(inner, type):
        return not issubclass(inner, LINEAR_OPTIMIZERS)
    return not isinstance(optimizer, LINEAR_OPTIMIZERS)


def _on_step(optimizer, args, kwargs) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _seen.get(optimizer) == count:  # groups unchanged since last seen: nothing to learn
        return
    with _lock:
        _seen[optimizer] = count
        if is_adaptive(optimizer):
            ref = weakref.ref(optimizer)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    _stepped_by[id(param)] = ref
                    if id(param) not in _adaptive:
                        _adaptive.add(id(param))
                        weakref.finalize(param, _forget, id(param))


def _forget(key: int) -> None:
    _adaptive.discard(key)
    _stepped_by.pop(key, None)


def second_moment(param) -> torch.Tensor | None:
    """The running mean square an adaptive optimizer divides ``param``'s update by (Adam's
    ``exp_avg_sq``, RMSprop's ``square_avg``, Adagrad's ``sum``), or None where it has none yet."""
    ref = _stepped_by.get(id(param))
    optimizer = ref() if ref is not None else None
    state = optimizer.state.get(param) if optimizer is not None else None
    if not state:
        return None
    for key in SECOND_MOMENT_KEYS:
        value = state.get(key)
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            return value
    return None


def watch() -> None:
    """Start watching optimizer steps (idempotent; the states call it when they are built)."""
    global _handle
    with _lock:
        if _handle is None:
            _handle = register_optimizer_step_pre_hook(_on_step)


def stepped_adaptively(params) -> bool:
    """Whether an adaptive optimizer has stepped any of ``params`` (so far in this process)."""
    return any(id(p) in _adaptive for p in params)


def moments(params) -> list:
    """CPU copies of ``params``' second moments (a sharded parameter's local shard; None where it
    has none): what a state's checkpoint keeps, because a resumed process learns which optimizer
    steps what only at that optimizer's first step, after the first backward has been reduced."""
    out = []
    for param in params:
        moment = second_moment(param)
        if moment is not None and hasattr(moment, "to_local"):
            moment = moment.to_local()
        out.append(None if moment is None else moment.detach().to("cpu", copy=True))
    return out


def units(params, segments, numel: int, device, saved=None) -> torch.Tensor | None:
    """What the adaptive optimizer divides each coordinate of a flat tensor by, in its layout: the
    root of the running mean square (plus Adam's default epsilon, and at least ``UNIT_FLOOR`` of
    the parameter's mean) of each of ``params`` at its ``(offset, shape)`` of ``segments``, 1
    elsewhere (padding); None where a parameter has none
    yet (before the optimizer's first step). A sharded parameter's (a DTensor's) local shard is
    the one its segment holds. ``saved``: ``moments`` of a checkpoint, one per parameter, for those
    no optimizer has stepped yet in this process."""
    found = [second_moment(p) for p in params]
    if saved is not None:
        found = [m if m is not None else s for m, s in zip(found, saved)]
    if not found or any(m is None for m in found):
        return None
    out = torch.ones(numel, dtype=torch.float32, device=device)
    for (offset, _), moment in zip(segments, found):
        local = moment.to_local() if hasattr(moment, "to_local") else moment
        view = out[offset:offset + local.numel()]
        torch.sqrt(local.detach().reshape(-1).to(view.device, torch.float32), out=view)
        view.add_(1e-8)
        torch.maximum(view, view.mean() * UNIT_FLOOR, out=view)  # no host read
    return out

