"""The state behind ``ciuicflow.fsdp.register``: each FSDP2 parameter group's shard, reduced across
nodes with a compressor of the registry after FSDP's own reduce-scatter inside the node.

FSDP2 sharded over the ranks of one node (``fully_shard(module, mesh=mesh["shard"])``) averages the
gradients inside the node with its reduce-scatter and hands each rank its shard (``reduce_output``)
to the all-reduce hook; here that hook averages the shard over ``mesh["replicate"]`` (the ranks that
hold the same shard, one per node) with the method's compressor, on a flat route over that group:
the hierarchical all-reduce with FSDP doing the intra-node half.

FSDP2 sharded over every rank (a 1-D mesh) has no all-reduce to compress: its reduce-scatter is
the collective that crosses nodes, so there the state is FSDP's custom reduce-scatter
(``set_custom_reduce_scatter``) and reduces with the compressor's quantised reduce-scatter
(``compression.quantized_scatter``), for the quantising flat methods ("onebit", "int8", "int4"): the
excluded parameters' positions of every row travel exact beside the packed ones, and the accuracy
guard measures and acts as on the all-reduce paths.

Per parameter group: the compressor's memory (error feedback, warm start), its layout (each
parameter's shard as an (offset, shape) pair, so PowerSGD sees matrices), the positions excluded
from compression, and its count of synchronised steps. ``state_dict()`` holds this rank's memory
under a key of its own, so ``torch.distributed.checkpoint`` saves every rank's and a resumed run
continues exactly.
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from ciuicflow.collectives.primitives import Hop, Traffic, reduce_scatter
from ciuicflow.collectives.routes import EXACT, FlatRoute
from ciuicflow.compression import registry
from ciuicflow.compression.base import Context, exclude_mask
from ciuicflow.compression.ledger import Ledger
from ciuicflow.compression.optimizer_watch import moments, stepped_adaptively, units, watch
from ciuicflow.ddp.state import DEFAULT_WARMUP_STEPS
from ciuicflow.topology import Topology

_STATE_VERSION = 1


def scatter_methods() -> list[str]:
    """The methods that compress FSDP's own reduce-scatter (a 1-D mesh): the flat ones whose
    compressor has a reduce-scatter form."""
    return [name for name, m in registry.METHODS.items()
            if not m.hierarchical and hasattr(m.entry.compressor_class(), "reduce_scatter")]


class _Group:
    """One FSDP parameter group (one ``fully_shard``-ed module)."""

    def __init__(self, index: int, name: str, param_group):
        self.index, self.name, self._param_group = index, name, param_group
        self.steps = 0  # synchronised steps this group's hook has seen
        self.memory = None
        self.segments: tuple | None = None  # known at the first call (FSDP's lazy init names params)
        self.names: list | None = None
        self.padded: tuple | None = None  # (offset, padded shard shape): a reduce-scatter row
        self.mask = None
        self.memory_layout: dict | None = None  # what the memory was made for
        self.pending = None  # a checkpoint's (layout, memory state), loaded at the first call
        # an adaptive optimizer steps its parameters: seen, or said by the checkpoint (a resumed
        # process's first backward comes before its optimizer's first step)
        self.adaptive = False
        # a checkpoint's second moments of the parameters (``optimizer_watch.moments``): the
        # units until the optimizer has stepped them in this process
        self.saved_moments: list | None = None

    def stepped_adaptively(self) -> bool:
        self.adaptive = self.adaptive or stepped_adaptively(self.parameters())
        return self.adaptive

    def resumed_moments(self) -> list | None:
        if self.saved_moments is not None and stepped_adaptively(self.parameters()):
            self.saved_moments = None
        return self.saved_moments

    def parameters(self) -> list:
        """The sharded parameters (what the optimizer steps)."""
        return [fsdp_param.sharded_param for fsdp_param in self._param_group.fsdp_params]

    def layout(self, numel: int) -> tuple:
        """((offset, shard shape) per parameter in the reduce output, their names), once."""
        if self.segments is None:
            segments, names, padded, offset = [], [], [], 0
            for fsdp_param in self._param_group.fsdp_params:
                segments.append((offset, tuple(fsdp_param.sharded_size)))
                padded.append((offset, tuple(fsdp_param.padded_sharded_param_size)))
                names.append(fsdp_param._param_fqn)
                offset += fsdp_param.padded_sharded_param_size.numel()
            if offset != numel:
                raise RuntimeError(f"ciuicflow.fsdp: FSDP's reduce output of {self.name or 'root'} "
                                   f"holds {numel} elements, its parameters' padded shards {offset}")
            self.segments, self.names, self.padded = tuple(segments), names, tuple(padded)
        return self.segments, self.names


class FSDPState:
    """Reduction of FSDP2 gradient shards across nodes with one method of the registry.

    Args (``register`` passes them):
        method: with a 2-D mesh, a hierarchical method: "hierarchical_allreduce" (exact),
            "hierarchical_1bit", "hierarchical_powersgd", "hierarchical_int8", "hierarchical_int4";
            with a 1-D mesh, a quantising flat one: "onebit", "int8", "int4".
        mesh: the 2-D DeviceMesh ("replicate", "shard") the model was sharded on (its "shard"
            dim), or the 1-D DeviceMesh of every rank it was sharded on (FSDP without HSDP).
        warmup_steps, exclude, seed: as for the DDP hooks' states.
        **options: the method's compressor's options, with the DDP hooks' defaults.
    """

    def __init__(self, method: str, mesh, *, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 exclude=(), seed: int = 0, **options):
        self.method = registry.method(method)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        self.scatter = getattr(mesh, "ndim", None) == 1  # FSDP over every rank: the reduce-scatter
        if not self.scatter and (getattr(mesh, "ndim", None) != 2
                                 or set(names) != {"replicate", "shard"}):
            raise ValueError("mesh must be a 2-D DeviceMesh with mesh_dim_names ('replicate', "
                             f"'shard') or a 1-D DeviceMesh, got {mesh!r}")
        if not self.scatter and not self.method.hierarchical:
            hierarchical = [n for n, m in registry.METHODS.items() if m.hierarchical]
            raise ValueError(f"with a 2-D mesh ciuicflow.fsdp takes the hierarchical methods "
                             f"({hierarchical}): FSDP reduce-scatters inside the node, ciuicflow "
                             f"reduces across nodes; got {method!r}")
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if self.scatter and self.method.name not in scatter_methods():
            raise ValueError(f"with a 1-D mesh (FSDP over every rank) ciuicflow.fsdp compresses "
                             f"FSDP's reduce-scatter, with {scatter_methods()}; got {method!r}")
        if "route" in options:
            # DDP's flat hooks choose between two routes; here the mesh has chosen: a user who
            # asks for one should hear that it is not taken, not have it ignored
            raise ValueError(f"route={options['route']!r} is an option of DDP's flat hooks; "
                             "ciuicflow.fsdp's exchange is set by its mesh (a 2-D mesh: FSDP "
                             "inside the node, HSDP's replicas across nodes; a 1-D mesh: FSDP's "
                             "own reduce-scatter)")
        self.compressor = self.method.entry.compressor_class()(**options)
        if self.scatter and options.get("outliers") not in (None, "auto", 0):
            # the reduce-scatter's rows have fixed sizes: it sends no values (compression.outliers)
            raise ValueError(f"outliers={options['outliers']!r}: FSDP's compressed reduce-scatter "
                             "(a 1-D mesh) sends no values; they are sent on HSDP's replicas "
                             "(a 2-D mesh, hierarchical_1bit)")
        self.exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
        self.mesh = mesh
        self.warmup_steps = int(warmup_steps)
        self.seed = int(seed)
        group = mesh.get_group() if self.scatter else mesh["replicate"].get_group()
        self.topology = Topology.detect(group)  # collective, once
        # the replicas exchange node sums (FSDP2 reduced inside the node first); unused by the
        # reduce-scatter
        self.route = FlatRoute(self.topology)
        self.groups: list[_Group] = []
        self._ledger = Ledger()
        watch()  # which parameters an adaptive optimizer steps (compression.optimizer_watch)

    @property
    def algorithm(self) -> str:
        return self.compressor.name

    # -- the hook ----------------------------------------------------------------------------

    def _new_group(self, name: str, param_group) -> _Group:
        group = _Group(len(self.groups), name, param_group)
        self.groups.append(group)
        return group

    def _record(self, step: int, compressed: bool, traffic: Traffic, start) -> None:
        if step + 1 > self._ledger.steps:  # the first group of a new step
            self._ledger.end_step(compressed)
        self._ledger.record(traffic, compressed, start)

    def add_group(self, name: str, param_group) -> "callable":
        group = self._new_group(name, param_group)
        return lambda reduce_output: self._reduce(group, reduce_output)

    def _reduce(self, group: _Group, reduce_output: torch.Tensor) -> None:
        start = self._ledger.start(reduce_output.device)
        step = group.steps
        group.steps += 1
        flat = reduce_output.view(-1)
        traffic = Traffic()
        compressed = self.compressor.compresses and step >= self.warmup_steps
        self.route.add_exact(traffic, flat)
        if compressed and flat.numel():
            memory = self._memory(group, flat)
            adaptive = group.stepped_adaptively()
            # quantised, and its noise measured, in the optimizer's units (compression.policy)
            scale = units(group.parameters(), group.segments, flat.numel(), flat.device,
                          group.resumed_moments()) if adaptive else None
            context = Context(group.segments, group.mask, step, group.index, self.seed, adaptive,
                              units=scale)
            self._ledger.note_adaptive(self.compressor, self.algorithm, adaptive, self.route,
                                       flat.device)
            self.compressor.exchange(flat, memory, self.route, context, traffic)
            self._note_guard(group, memory)
        else:
            self.route.reduce(flat, EXACT, traffic)
        self._record(step, compressed, traffic, start)

    def add_scatter_group(self, name: str, param_group) -> "CompressedReduceScatter":
        return CompressedReduceScatter(self, self._new_group(name, param_group))

    def _reduce_scatter(self, group: _Group, output: torch.Tensor, rows: torch.Tensor,
                        scale: float) -> None:
        """``output`` = ``scale`` x the sum over every rank of its row for this rank."""
        start = self._ledger.start(output.device)
        step = group.steps
        group.steps += 1
        hop = Hop.flat(self.topology)
        traffic = Traffic()
        traffic.add_exact(hop, (hop.size - 1) / hop.size * rows.numel() * rows.element_size())
        compressed = step >= self.warmup_steps
        if compressed and output.numel():
            memory = self._memory(group, output.view(-1))
            adaptive = group.stepped_adaptively()
            self._ledger.note_adaptive(self.compressor, self.algorithm, adaptive, None,
                                       rows.device)
            self.compressor.reduce_scatter(output.view(-1), rows, memory, hop, traffic, scale,
                                           exact_mask=group.mask, adaptive=adaptive)
            self._note_guard(group, memory)
        else:
            reduce_scatter(output, rows, hop, traffic)
            if scale != 1.0:
                output.mul_(scale)
        self._record(step, compressed, traffic, start)

    def _note_guard(self, group: _Group, memory) -> None:
        what = f"parameter group {group.name or '(root)'}"
        self._ledger.note_guard(self.compressor, self.algorithm, group.name, what,
                                memory.relative_error)
        self._ledger.note_plan(group.name, what, memory.wire_plan)

    def _memory(self, group: _Group, flat: torch.Tensor):
        if group.memory is None:
            segments, names = group.layout(flat.numel())
            if self.exclude:  # a reduce-scatter row holds every rank's padded shard: one mask
                group.mask = exclude_mask(self.exclude, names, group.padded if self.scatter
                                          else segments, flat.numel(), flat.device)
            group.memory = self.compressor.new_scatter_memory() if self.scatter else \
                self.compressor.new_memory()
            group.memory_layout = _layout(flat, segments)
            if group.pending is not None:
                layout, tensors = group.pending
                if layout == group.memory_layout:
                    group.memory.load_state_dict(tensors)
                else:
                    self._ledger.warn_once(f"layout{group.name}", (
                        f"ciuicflow.fsdp: the checkpoint's memory of {group.name or '(root)'} was "
                        f"saved for another layout ({layout}); it starts from zero"))
                group.pending = None
        return group.memory

    # -- statistics and checkpoints ---------------------------------------------------------

    def stats(self) -> dict:
        """As the DDP hooks' ``stats()``; ``buckets`` counts parameter-group reductions."""
        return self._ledger.stats(self.algorithm, self.topology)

    def reset_stats(self) -> None:
        self._ledger.reset()

    def state_dict(self) -> dict:
        """For ``torch.distributed.checkpoint`` (or ``torch.save``): the shared configuration, and
        this rank's memory, steps and statistics under ``rank<R>`` (DCP saves each rank's own)."""
        mine = {"groups": {g.name: {"steps": g.steps, "memory": _memory_state(g),
                                    "adaptive": g.adaptive,
                                    "moments": (g.resumed_moments() or moments(g.parameters()))
                                    if g.adaptive else None}
                           for g in self.groups},
                "stats": self._ledger.state_dict()}
        blob = io.BytesIO()
        torch.save(mine, blob)
        return {"version": _STATE_VERSION, "algorithm": self.algorithm,
                "method": self.method.name, "config": self._config(),
                f"rank{dist.get_rank()}": blob.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown ciuicflow.fsdp checkpoint version {state.get('version')!r}")
        if state.get("method") != self.method.name:
            raise ValueError(f"checkpoint is for {state.get('method')!r}, this state is "
                             f"{self.method.name!r}")
        for name in self.compressor.layout_options:
            if state["config"].get(name) != getattr(self.compressor, name):
                raise ValueError(f"checkpoint has {name}={state['config'].get(name)!r}, this state "
                                 f"{getattr(self.compressor, name)!r}: its memory does not fit")
        blob = state.get(f"rank{dist.get_rank()}")
        if not blob:
            raise ValueError(f"the checkpoint holds no state of rank {dist.get_rank()} (saved with "
                             "another world size?)")
        mine = torch.load(io.BytesIO(blob), weights_only=True)
        saved = mine["groups"]
        for group in self.groups:
            entry = saved.get(group.name)
            if entry is None:
                raise ValueError(f"the checkpoint has no parameter group {group.name!r}; it has "
                                 f"{sorted(saved)}")
            group.steps = int(entry["steps"])
            group.adaptive = bool(entry.get("adaptive", False))
            group.saved_moments = entry.get("moments")
            group.memory, group.pending = None, entry["memory"]
        self._ledger.load_state_dict(mine["stats"])

    def _config(self) -> dict:
        return {"warmup_steps": self.warmup_steps, "exclude": self.exclude, "seed": self.seed,
                **self.compressor.options()}


def _layout(flat: torch.Tensor, segments) -> dict:
    return {"numel": flat.numel(), "dtype": str(flat.dtype), "segments": list(segments)}


def _memory_state(group: _Group):
    """(layout, memory tensors on the CPU) of a group, or what a checkpoint left pending."""
    if group.memory is None:
        return group.pending
    tensors = {k: (v.cpu() if isinstance(v, torch.Tensor) else v)
               for k, v in group.memory.state_dict().items()}
    return group.memory_layout, tensors


try:  # FSDP2's interface for a custom reduce-scatter (torch >= 2.9)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older torch: register() says so
    _ReduceScatterBase = object


class CompressedReduceScatter(_ReduceScatterBase):
    """FSDP2's reduce-scatter of one parameter group, through ``FSDPState._reduce_scatter``.

    FSDP calls it on its reduce-scatter stream with the group's gradients laid out as one row per
    rank; ``op`` is SUM or AVG (FSDP divides before or after where the dtype needs it)."""

    def __init__(self, state: FSDPState, group: _Group):
        self.state, self.group = state, group

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        world = dist.get_world_size(group)
        if op == dist.ReduceOp.SUM:
            scale = 1.0
        elif op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        else:
            raise ValueError(f"ciuicflow.fsdp: FSDP asked for a reduce-scatter with {op}; the "
                             "compressed one does SUM and AVG (a gradient divide factor other than "
                             "the world size asks for PREMUL_SUM: leave it unset)")
        self.state._reduce_scatter(self.group, output_tensor, input_tensor, scale)
        return None
