"""DDP communication hooks and their states, one per method of the compression registry.

    state = ciuicflow.OneBitState(warmup_steps=10)
    ddp_model.register_comm_hook(state, ciuicflow.hierarchical_1bit)
    # or, binding parameter names (needed by exclude patterns and exact checkpoint resume):
    state = ciuicflow.register(ddp_model, "hierarchical_1bit", exclude=["*.bias", "*norm*"])

A hook is ``hook(state, bucket) -> Future[Tensor]`` (the mean of the bucket over the group); its
state class is the registry entry's (``OneBitState`` for ``hierarchical_1bit`` and ``onebit``).
Every hook and state is defined below, one per method and family of the registry (checked at
import). ``HOOKS`` maps each method's name to ``(hook, state class)``.

Ordering: DDP calls the hook of each bucket in bucket order, the same on every rank, while
backward is still running; every collective of a bucket is issued by one thread in that order
(``ddp.worker``). The hook of the last bucket waits for the worker to finish, so DDP's own
collectives at the end of backward come after ours on every rank.
"""
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ciuicflow.compression import registry
from ciuicflow.compression.int4 import Int4Compressor
from ciuicflow.compression.int8 import Int8Compressor
from ciuicflow.compression.onebit import OneBitCompressor
from ciuicflow.compression.powersgd import PowerSGDCompressor
from ciuicflow.ddp.state import DEFAULT_WARMUP_STEPS, AllReduceState, CompressingState


class _DefaultStates:
    """The states of one hook registered with ``state=None``: one per model, told apart by the
    parameters its buckets hold (a parameter belongs to one model). A state shared by two models
    would mix them up: its step counter would advance once per model (warm-up ending early), two
    same-layout buckets would share an error memory, and the memory of buckets not seen since the
    last step -- the other model's -- would be dropped at every step.

    DDP's first step reduces one bucket holding every parameter (its buckets are rebuilt after
    it), so a bucket with no known parameter starts a new model; a bucket of index > 0 with none
    (DDP modes that keep several buckets from the start) belongs to the model whose first step is
    under way."""

    def __init__(self, cls: type, world):
        self.cls, self.world = cls, world
        # held only through its model's parameters: a state goes when its model does
        self._by_param: dict[int, AllReduceState] = {}  # id(parameter) -> its model's state
        self._last = lambda: None  # a weak reference to the state built last
        self._opening: AllReduceState | None = None  # a state whose first step is under way

    def for_bucket(self, bucket: dist.GradBucket) -> AllReduceState:
        params = bucket.parameters()
        first = self._by_param.get(id(params[0])) if params else None
        if first is not None and self._by_param.get(id(params[-1])) is first:
            state = first  # the common case: a bucket of a known model
        else:
            state = self._claim(params, bucket.index())
        if bucket.is_last() and self._opening is state:
            self._opening = None
        return state

    def _claim(self, params, index: int) -> AllReduceState:
        owners = {id(s): s for s in (self._by_param.get(id(p)) for p in params) if s is not None}
        if len(owners) > 1:
            raise RuntimeError(
                "ciuicflow: a DDP bucket holds parameters of two models that share a hook's "
                "default state (state=None); give each model its own state: "
                "ciuicflow.register(model, method) or model.register_comm_hook(State(), hook)")
        if owners:
            state = next(iter(owners.values()))
        elif index > 0 and self._opening is not None:
            state = self._opening
        else:
            state = self._opening = self.cls()
            self._last = weakref.ref(state)
        for p in params:
            if id(p) not in self._by_param:
                self._by_param[id(p)] = state
                weakref.finalize(p, self._by_param.pop, id(p), None)
        return state


_DEFAULT_STATES: dict[str, _DefaultStates] = {}  # hook name -> its default states


def default_state(hook_name: str, model: torch.nn.Module | None = None) -> AllReduceState | None:
    """The state a hook registered with ``state=None`` built for ``model`` (the module DDP wraps,
    or the DDP module), per process; without ``model``, the one it built last. None if none."""
    entry = _DEFAULT_STATES.get(hook_name)
    if entry is None:
        return None
    if model is None:
        return entry._last()
    first = next(iter(model.parameters()), None)
    return entry._by_param.get(id(first)) if first is not None else None


def _state_for(state, cls, hook_name: str, bucket: dist.GradBucket):
    if state is None:
        world = dist.distributed_c10d._get_default_group()
        entry = _DEFAULT_STATES.get(hook_name)
        if entry is None or entry.world is not world:  # a new init_process_group: new states
            entry = _DEFAULT_STATES[hook_name] = _DefaultStates(cls, world)
        return entry.for_bucket(bucket)
    if not isinstance(state, cls):
        raise TypeError(f"{hook_name} needs a {cls.__name__} (or None), got {type(state).__name__}")
    return state


class OneBitState(CompressingState):
    """State of ``hierarchical_1bit`` and ``onebit``: 1-bit signs with a scale per chunk and error
    feedback (``compression.onebit.OneBitCompressor``: its options, and what the policy sends an
    adaptive optimizer's buckets as). Besides ``CompressingState``'s arguments, the compressor's
    options: ``chunk_size``, ``error_decay``, ``phases``, ``guard``, ``guard_threshold``,
    ``adaptive_optimizer``, ``route`` (the flat hook's), ``server_codec``, ``outliers``."""

    compressor_class = OneBitCompressor


class PowerSGDState(CompressingState):
    """State of ``hierarchical_powersgd`` and ``powersgd``: rank-r PowerSGD factors with error
    feedback and warm start, per expert for stacked expert weights
    (``compression.powersgd.PowerSGDCompressor``: ``rank``, ``adaptive_rank``,
    ``min_compression_rate``, ``guard``, ``guard_threshold``, ...)."""

    compressor_class = PowerSGDCompressor


class Int8State(CompressingState):
    """State of ``hierarchical_int8`` and ``int8``: int8 values with a scale per chunk and error
    feedback (``compression.int8.Int8Compressor``; options as ``OneBitState``'s but
    ``outliers``)."""

    compressor_class = Int8Compressor


class Int4State(CompressingState):
    """State of ``hierarchical_int4`` and ``int4``: 4-bit values with a scale per chunk and error
    feedback, raised to int8 per bucket under an adaptive optimizer where its measured noise says
    so (``compression.int4.Int4Compressor``; options as ``Int8State``'s)."""

    compressor_class = Int4Compressor


def _reduce(state, bucket: dist.GradBucket, name: str) -> torch.futures.Future[torch.Tensor]:
    cls = HOOKS[name][1]
    return _state_for(state, cls, name, bucket)._hook(bucket, registry.METHODS[name].route)


def hierarchical_allreduce(state, bucket):
    """Exact mean: intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather."""
    return _reduce(state, bucket, "hierarchical_allreduce")


def hierarchical_1bit(state, bucket):
    """Exact inside nodes, 1-bit signs with a scale per chunk and error feedback between nodes."""
    return _reduce(state, bucket, "hierarchical_1bit")


def onebit(state, bucket):
    """1-bit signs with a scale per chunk and error feedback, over the whole group."""
    return _reduce(state, bucket, "onebit")


def hierarchical_powersgd(state, bucket):
    """Exact inside nodes, rank-r PowerSGD factors with error feedback between nodes."""
    return _reduce(state, bucket, "hierarchical_powersgd")


def powersgd(state, bucket):
    """Rank-r PowerSGD factors with error feedback and warm start, over the whole group."""
    return _reduce(state, bucket, "powersgd")


def hierarchical_int8(state, bucket):
    """Exact inside nodes, int8 values with a scale per chunk and error feedback between nodes."""
    return _reduce(state, bucket, "hierarchical_int8")


def int8(state, bucket):
    """int8 values with a scale per chunk and error feedback, over the whole group."""
    return _reduce(state, bucket, "int8")


def hierarchical_int4(state, bucket):
    """Exact inside nodes, 4-bit values with a scale per chunk and error feedback between nodes."""
    return _reduce(state, bucket, "hierarchical_int4")


def int4(state, bucket):
    """4-bit values with a scale per chunk and error feedback, over the whole group."""
    return _reduce(state, bucket, "int4")


STATES: dict[str, type] = {cls.__name__: cls for cls in (
    AllReduceState, OneBitState, PowerSGDState, Int8State, Int4State)}
HOOKS: dict[str, tuple[Callable, type]] = {
    name: (globals()[name], STATES[method.entry.state]) for name, method in registry.METHODS.items()}


def _check_against_registry() -> None:
    """The registry names every method once; this module defines each one's hook and state in
    source (so a reader finds them): a method or compressor added there without them here fails
    at import, not at a user's first bucket."""
    for entry in registry.ENTRIES:
        cls = STATES.get(entry.state)
        if cls is None or cls.compressor_class is not entry.compressor_class():
            raise ImportError(f"ciuicflow.ddp.hooks: registry entry {entry.family!r} needs its "
                              f"state class {entry.state!r} defined here with its compressor")


_check_against_registry()


def register(model: torch.nn.parallel.DistributedDataParallel, hook: str = "hierarchical_1bit",
             **options) -> AllReduceState:
    """Build the hook's state (bound to the model's parameter names), register it, return it.

    ``options`` go to the state's constructor, e.g. ``register(ddp, "hierarchical_powersgd",
    rank=4, warmup_steps=100, exclude=["*norm*"])``.
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register needs a DistributedDataParallel model, got "
                        f"{type(model).__name__}")
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; choose one of {sorted(HOOKS)}")
    function, cls = HOOKS[hook]
    if "route" in options and registry.METHODS[hook].hierarchical:
        # the hierarchical hooks always take their route: a route asked of one would be ignored
        raise ValueError(f"route={options['route']!r} is an option of the flat hooks "
                         f"(onebit, int8, int4); {hook!r} always takes the hierarchical route")
    options.setdefault("process_group", model.process_group)
    state = cls(model=model, **options)
    model.register_comm_hook(state, function)
    return state


__all__ = ["register", "default_state", "HOOKS", "STATES", "DEFAULT_WARMUP_STEPS",
           "AllReduceState", "OneBitState", "PowerSGDState", "Int8State", "Int4State",
           "hierarchical_allreduce", "hierarchical_1bit", "onebit", "hierarchical_powersgd",
           "powersgd", "hierarchical_int8", "int8", "hierarchical_int4", "int4"]
