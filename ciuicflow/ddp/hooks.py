"""DDP communication hooks and their states, one per method of the compression registry.

    state = ciuicflow.OneBitState(warmup_steps=10)
    ddp_model.register_comm_hook(state, ciuicflow.hierarchical_1bit)
    # or, binding parameter names (needed by exclude patterns and exact checkpoint resume):
    state = ciuicflow.register(ddp_model, "hierarchical_1bit", exclude=["*.bias", "*norm*"])

A hook is ``hook(state, bucket) -> Future[Tensor]`` (the mean of the bucket over the group); its
state class is the registry entry's (``OneBitState`` for ``hierarchical_1bit`` and ``onebit``).
``HOOKS`` maps each method's name to ``(hook, state class)``.

Ordering: DDP calls the hook of each bucket in bucket order, the same on every rank, while
backward is still running; every collective of a bucket is issued by one thread in that order
(``ddp.worker``). The hook of the last bucket waits for the worker to finish, so DDP's own
collectives at the end of backward come after ours on every rank.
"""
import inspect
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ciuicflow.compression import registry
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


def _state_class(entry: registry.Entry) -> type:
    compressor = entry.compressor_class()
    if not compressor.compresses:
        return AllReduceState
    names = " and ".join(f"``{name}``" for name in entry.methods.values())
    # the docs of the compressor and of its bases up to Compressor: what its options mean
    compressor_docs = [_indent(c.__doc__) for c in compressor.__mro__
                       if c.__doc__ and "compression.base" not in c.__module__
                       and c is not object]
    doc = "\n\n".join([f"State of {names}: {entry.summary}.",
                        f"    The compressor: ``{compressor.__module__}.{compressor.__name__}``.",
                        *compressor_docs, _indent(CompressingState.__doc__)])
    return type(entry.state, (CompressingState,), {
        "compressor_class": compressor, "__doc__": doc, "__module__": __name__})


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in inspect.cleandoc(text).splitlines())


def _hook(method: registry.Method, cls: type) -> Callable:
    name, route = method.name, method.route

    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return _state_for(state, cls, name, bucket)._hook(bucket, route)

    hook.__name__ = hook.__qualname__ = name
    hook.__module__ = __name__
    hook.__doc__ = f"{method.description[0].upper()}{method.description[1:]}."
    return hook


STATES: dict[str, type] = {entry.state: _state_class(entry) for entry in registry.ENTRIES}
HOOKS: dict[str, tuple[Callable, type]] = {}
for _method in registry.METHODS.values():
    _cls = STATES[_method.entry.state]
    HOOKS[_method.name] = (_hook(_method, _cls), _cls)
globals().update(STATES)
globals().update({name: hook for name, (hook, _) in HOOKS.items()})
del _method, _cls


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
           *STATES, *HOOKS]
