"""DDP hook states: one generic state over a compressor and a route, and its compressing form.

A state owns what outlives a step: the topology (detected at first use), the per-bucket memories
(``BucketMemories``), the parameter names (exclude patterns, resume), statistics, warm-up. The
compressor (``ciuicflow.compression``) owns the math; ``ddp.hooks`` makes one state class per
compressor of the registry (``OneBitState``, ``PowerSGDState``, ...).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import Traffic
from ciuicflow.collectives.routes import EXACT, ROUTES
from ciuicflow.compression.base import Compressor, Context, ExactCompressor, exclude_mask
from ciuicflow.compression.ledger import Ledger
from ciuicflow.compression.optimizer_watch import moments, stepped_adaptively, units, watch
from ciuicflow.ddp.bucket import BucketMemories, BucketView
from ciuicflow.ddp.worker import completed, ordered_worker
from ciuicflow.topology import Topology

DEFAULT_WARMUP_STEPS = 10
_STATE_VERSION = 1


class AllReduceState:
    """State of ``hierarchical_allreduce``: the group, its topology, statistics.

    Args:
        process_group: the group to reduce over (default: the default group, at first use).
        topology: a ``Topology`` of that group (default: ``Topology.detect``, at first use).
        overlap: issue collectives on the ordered worker thread (True) or inside the hook.
        model: the (DDP) model, to learn parameter names; ``register`` passes it.
    """

    compressor_class: type[Compressor] = ExactCompressor
    _config_fields = ("overlap",)

    def __init__(self, process_group=None, topology: Topology | None = None, *,
                 overlap: bool = True, model: torch.nn.Module | None = None, **options):
        self.compressor = self.compressor_class(**options)
        if topology is not None and process_group is not None \
                and topology.group is not process_group:
            raise ValueError("topology was detected on a different process group")
        self.process_group = process_group if process_group is not None else \
            (topology.group if topology is not None else None)
        self.topology = topology
        self.overlap = bool(overlap)
        self.warmup_steps = 0
        self.exclude: tuple[str, ...] = ()
        self.seed = 0
        self.iter = 0  # synchronised steps seen by the hook (no_sync steps do not count)
        self._memories = BucketMemories(self.compressor.new_memory)
        self._names: dict[int, str] = {}
        # names of parameters an adaptive optimizer steps: checkpointed, so that a resumed
        # process sends them as before from its first step, before its optimizer has stepped
        self._adaptive_names: set[str] = set()
        self._params: dict[str, torch.nn.Parameter] = {}  # by name (``bind_model``)
        # a checkpoint's second moments by name, for the units of the steps a resumed process
        # reduces before its optimizer's first step (``optimizer_watch.moments``)
        self._saved_moments: dict[str, torch.Tensor] = {}
        self._masks: dict[str, torch.Tensor | None] = {}
        self._routes: dict = {}
        self._ledger = Ledger()
        # the first exception a bucket's reduction raised: a rank that fails part-way through
        # its collectives no longer issues them in its peers' order, so later buckets must not go
        self._failure: BaseException | None = None
        if model is not None:
            self.bind_model(model)

    @property
    def algorithm(self) -> str:
        return self.compressor.name

    def __getattr__(self, name):
        # the compressor's options read as the state's own (state.chunk_size, state.rank, ...)
        compressor = self.__dict__.get("compressor")
        if compressor is not None and name in compressor.option_names:
            return getattr(compressor, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    # -- public ------------------------------------------------------------------------------

    def bind_model(self, model: torch.nn.Module) -> "AllReduceState":
        """Learn parameter names (for ``exclude`` patterns and resume); ``register`` does this."""
        module = getattr(model, "module", model)
        self._names = {id(param): name for name, param in module.named_parameters()}
        self._params = dict(module.named_parameters())
        self._masks.clear()
        return self

    def reset_stats(self) -> None:
        self._ledger.reset()
        if hasattr(self.compressor, "reset_group_stats"):
            self.compressor.reset_group_stats()

    def stats(self) -> dict:
        """Communication statistics of this rank since the last ``reset_stats()`` (see
        ``compression.ledger.Ledger.stats``; ``buckets`` counts DDP buckets reduced); PowerSGD's
        add ``groups``, the elements in and sent per parameter group."""
        stats = self._ledger.stats(self.algorithm, self.topology)
        if hasattr(self.compressor, "group_stats"):
            stats["groups"] = self.compressor.group_stats()
        return stats

    def state_dict(self) -> dict:
        """Everything a resumed run needs to continue exactly (no process group)."""
        return {
            "version": _STATE_VERSION,
            "algorithm": self.algorithm,
            "config": self._config(),
            "iter": self.iter,
            "memory": self._memories.state_dict(),
            "stats": self._ledger.state_dict(),
            "adaptive": sorted(self._adaptive_names),
            "moments": self._moments(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm") != self.algorithm:
            raise ValueError(f"checkpoint is for {state.get('algorithm')!r} hooks, "
                             f"this state is {self.algorithm!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown checkpoint version {state.get('version')!r}")
        for name in self.compressor.layout_options:
            if state["config"].get(name) != getattr(self, name):
                raise ValueError(f"checkpoint has {name}={state['config'].get(name)!r}, this state "
                                 f"{getattr(self, name)!r}: its memory does not fit")
        self.iter = int(state["iter"])
        self._adaptive_names = set(state.get("adaptive", ()))
        self._saved_moments = dict(state.get("moments", {}))
        self._memories.load_state_dict(state["memory"])
        self._ledger.load_state_dict(state.get("stats", {}))

    def __getstate__(self) -> dict:
        # The process group, the topology (it holds groups) and parameter identities stay behind.
        return {"config": self._config(), "state": self.state_dict()}

    def __setstate__(self, pickled: dict) -> None:
        self.__init__(**pickled["config"])
        self.load_state_dict(pickled["state"])

    # -- what hooks call ---------------------------------------------------------------------

    def _config(self) -> dict:
        return {**{name: getattr(self, name) for name in self._config_fields},
                **self.compressor.options()}

    def _resolve(self) -> Topology:
        """The topology, detected on first use (collective: runs in hook order on every rank)."""
        if self.topology is None:
            self.topology = Topology.detect(self.process_group)
            self.process_group = self.topology.group
        return self.topology

    def _route(self, name: str):
        route = self._routes.get(name)
        if route is None:
            route = self._routes[name] = ROUTES[name](self._resolve())
        return route

    def _hook(self, bucket: dist.GradBucket, route: str) -> torch.futures.Future:
        if route == "hierarchical" and getattr(self.compressor, "route_asked", False):
            # a route asked of a hierarchical hook would be ignored (register() refuses it too)
            raise ValueError(f"this state asks route={self.compressor.route!r}, an option of "
                             f"the flat hook ({self.compressor.name!r}); a hierarchical hook always takes the "
                             f"hierarchical route")
        info = BucketView.read(bucket)
        step = self.iter
        if info.is_last:
            self.iter += 1
        job = lambda: self._reduce_or_refuse(info, step, route)  # noqa: E731
        if not self.overlap:
            return completed(job())
        future = ordered_worker().submit(job, info.buffer)
        if info.is_last:
            future.wait()  # the worker is idle again before DDP issues its own collectives
        return future

    def _reduce_or_refuse(self, info: BucketView, step: int, route_name: str) -> torch.Tensor:
        if self._failure is not None:
            raise RuntimeError(
                f"bucket {info.index} of step {step} was not reduced: an earlier bucket of this "
                f"state failed ({type(self._failure).__name__}: {self._failure}), after which this "
                f"rank's collectives may no longer match its peers'; restart the processes "
                f"(or build a new process group and state)") from self._failure
        try:
            return self._reduce_bucket(info, step, route_name)
        except BaseException as exc:
            self._failure = exc
            raise

    def _reduce_bucket(self, info: BucketView, step: int, route_name: str) -> torch.Tensor:
        start = self._ledger.start(info.buffer.device)
        route = self._route(route_name)
        traffic = Traffic()
        past_warmup = self.compressor.compresses and step >= self.warmup_steps
        # from the first step: the warm-up's exact mean costs the flat ring's bytes otherwise
        if self.compressor.compresses and route.name != "hierarchical" \
                and route.topology.world_size > 1:
            route = self.compressor.route_for(route, self._route("hierarchical"),
                                              info.buffer.device)
        result = info.buffer
        if info.buffer.numel() and route.topology.world_size > 1:
            # the route may hand back its own copy of the mean (node_shm's kept output) instead
            # of writing it into the bucket: DDP copies the hook's result into the gradients.
            # The key is this state's and bucket's: the bucket's memory tells apart two models
            # that share a state (the hook's default one) and a bucket layout, whose areas would
            # otherwise collide in one backward pass. Not on DDP's first step, whose one bucket
            # of every parameter is rebuilt after it.
            keep = None if step == 0 else (id(self), info.index, info.buffer.numel(),
                                           info.buffer.data_ptr())
            result = past_warmup and self._reduce_compressed(info, route, step, traffic, keep)
            if result is False:
                route.add_exact(traffic, info.buffer)
                result = route.reduce(info.buffer, EXACT, traffic, keep=keep)
        self._ledger.record(traffic, past_warmup, start)
        if info.is_last:
            self._ledger.end_step(past_warmup)
            if past_warmup:
                self._memories.end_of_step(self._ledger.warn_once)
        return result

    def _reduce_compressed(self, info: BucketView, route, step: int, traffic: Traffic, keep=None):
        """Compress this bucket if its memory is at hand and return what holds the mean; False:
        reduce it exactly this step."""
        names = self._param_names(info)
        hierarchical = route.name == "hierarchical"
        memory = self._memories.get(info, hierarchical, names)
        if memory is not None:
            return self._compress(info, memory, route, step, traffic, keep)
        pieces = self._memories.pieces(info, hierarchical, names)
        if pieces is None:
            self._warn_once("layout", "ciuicflow: a DDP bucket does not match the checkpoint's "
                            "buckets and parameter names are unknown (use ciuicflow.register or "
                            "state.bind_model); it is all-reduced exactly until they match")
            return False
        where = {name: offset for name, (offset, _) in zip(names, info.segments)}
        by_name = dict(zip(names, info.parameters))
        for key, layout, memory in pieces:
            # the checkpoint's bucket, rebuilt from this bucket's gradients
            sizes = [torch.Size(shape).numel() for _, shape in layout["segments"]]
            buffer = torch.cat([info.buffer[where[p]:where[p] + n]
                                for p, n in zip(layout["params"], sizes)])
            piece = BucketView(layout["index"], buffer, False, layout["segments"],
                               [by_name[p] for p in layout["params"]])
            self._compress(piece, memory, route, step, traffic)
            self._memories.mark_used(key)
            for p, n, (offset, _) in zip(layout["params"], sizes, layout["segments"]):
                info.buffer[where[p]:where[p] + n].copy_(buffer[offset:offset + n])
        return info.buffer

    def _adaptive(self, params) -> bool:
        """Whether an adaptive optimizer steps any of ``params``: seen stepping them in this
        process (``optimizer_watch``), or named so by the checkpoint this state resumed from."""
        if stepped_adaptively(params):
            names = [self._names.get(id(p)) for p in params]
            self._adaptive_names.update(name for name in names if name is not None)
            return True
        return bool(self._adaptive_names) and any(
            self._names.get(id(p)) in self._adaptive_names for p in params)

    def _moments(self) -> dict:
        """Second moments of the adaptively stepped parameters, by name, for the checkpoint."""
        names = sorted(n for n in self._adaptive_names if n in self._params)
        found = moments([self._params[n] for n in names])
        live = {n: m for n, m in zip(names, found) if m is not None}
        return {**self._saved_moments, **live}  # a checkpoint's, where none stepped here yet

    def _resumed_moments(self, params) -> list | None:
        """The checkpoint's moments of ``params`` until an optimizer has stepped them here."""
        if not self._saved_moments:
            return None
        names = [self._names.get(id(p)) for p in params]
        if stepped_adaptively(params):  # the optimizer's own from now on
            for name in names:
                self._saved_moments.pop(name, None)
            return None
        return [self._saved_moments.get(name) for name in names]

    def _param_names(self, info: BucketView):
        if not self._names:
            return None
        names = [self._names.get(id(p)) for p in info.parameters]
        return None if None in names else names

    def _compress(self, info: BucketView, memory, route, step: int, traffic: Traffic,
                  keep=None) -> torch.Tensor:
        """What holds the mean: ``info.buffer``, or with ``keep`` maybe the route's copy."""
        adaptive = self._adaptive(info.parameters)
        context = Context(tuple(info.segments), self._exact_mask(info, route.name == "hierarchical"),
                          step, info.index, self.seed, adaptive, keep,
                          units=units(info.parameters, info.segments, info.buffer.numel(),
                                      info.buffer.device, self._resumed_moments(info.parameters))
                          if adaptive else None)
        self._ledger.note_adaptive(self.compressor, self.algorithm, adaptive, route,
                                   info.buffer.device)
        route.add_exact(traffic, info.buffer)
        result = self.compressor.exchange(info.buffer, memory, route, context, traffic)
        self._check_guard(info, memory.relative_error)
        self._ledger.note_plan(info.index, f"bucket {info.index}", memory.wire_plan)
        return info.buffer if result is None else result

    def _exact_mask(self, info: BucketView, hierarchical: bool) -> torch.Tensor | None:
        """True where the bucket holds a parameter matching an ``exclude`` pattern."""
        if not self.exclude:
            return None
        key = info.key(hierarchical)
        if key in self._masks:
            return self._masks[key]
        names = self._param_names(info)
        if names is None:
            raise RuntimeError(
                "exclude patterns need parameter names: use ciuicflow.register(model, ...) "
                "or state.bind_model(model) (also after unpickling a state)")
        self._masks[key] = exclude_mask(self.exclude, names, info.segments,
                                        info.buffer.numel(), info.buffer.device)
        return self._masks[key]

    def _check_guard(self, info: BucketView, relative_error: float | None) -> None:
        self._ledger.note_guard(self.compressor, self.algorithm, info.index,
                                f"bucket {info.index}", relative_error)

    def _warn_once(self, tag: str, message: str) -> None:
        self._ledger.warn_once(tag, message)


class CompressingState(AllReduceState):
    """State of a compressing hook. Besides ``AllReduceState``'s arguments:

    Args:
        warmup_steps: synchronised steps all-reduced exactly before compression starts.
        exclude: parameter-name patterns (``fnmatch``, e.g. ``"*.bias"``, ``"*norm*"``) reduced
            exactly; names come from ``register(model, ...)`` or ``bind_model(model)``.
        seed: seeds anything random in the compressor (the same on every rank).
        **options: the compressor's options (its class documents them).
    """

    _config_fields = ("overlap", "warmup_steps", "exclude", "seed")

    def __init__(self, process_group=None, topology=None, *,
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, exclude=(), seed: int = 0,
                 overlap: bool = True, model=None, **options):
        super().__init__(process_group, topology, overlap=overlap, model=model, **options)
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if isinstance(exclude, str):
            exclude = (exclude,)
        self.warmup_steps = int(warmup_steps)
        self.exclude = tuple(exclude)
        self.seed = int(seed)
        watch()  # which parameters an adaptive optimizer steps (compression.optimizer_watch)
