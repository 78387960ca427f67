"""The quantising compressors' common form: options, memory and the exchange of
``quantized_exchange`` over a route (1-bit and int8 are a codec and defaults on top)."""
from __future__ import annotations

import logging

import torch

from ciuicflow.collectives.primitives import Traffic, check_reducible
from ciuicflow.collectives.routes import FlatRoute, HierarchicalRoute
from ciuicflow.compression.base import Compressor, Context
from ciuicflow.compression.quantized_exchange import Codec, QuantizedErrors, QuantizedStep, \
    native_ops
from ciuicflow.compression.quantized_scatter import ScatterErrors, quantized_reduce_scatter
from ciuicflow.compression import policy
from ciuicflow.compression.policy import ROUTE_POLICIES
from ciuicflow.compression.registry import FAMILIES, adaptive_bytes_per_element
from ciuicflow.topology import Topology

log = logging.getLogger("ciuicflow.compression")

__all__ = ["Codec", "QuantizedCompressor", "QuantizedErrors", "QuantizedStep", "native_ops",
           "quantized_all_reduce"]


class QuantizedCompressor(Compressor):
    """Base of the quantising compressors: a subclass sets ``name``, ``codec`` and its defaults.

    Options (what each sends, and the "auto" defaults: ``compression.policy``, which
    ``ciuicflow.explain`` prints; why: docs/decisions.md):
        chunk_size: elements that share one scale (a positive multiple of the codec's granule).
        error_decay: share of the error-feedback memory carried into the next step, in [0, 1]
            (1: classic error feedback).
        phases: 2 (each rank serves a segment and quantises its mean again: 2(W-1)/W of the packed
            bytes), 1 (every rank gathers every packed tensor: (W-1)), or "auto" (the policy's).
        server_codec: what the servers of two phases pack each segment's mean with: "auto" (the
            policy's), "same" (this compressor's codec) or one of ``server_codecs`` by name.
        guard: the accuracy guard: "warn" (a RuntimeWarning when a tensor's relative error,
            ||error-feedback memory|| / ||gradient||, exceeds ``guard_threshold``), "exact" (such a
            tensor's next step sends exactly what it would have compressed: its input plus the
            memory, decayed by ``error_decay``), "fp16" (the same step in float16: half the bytes,
            the rounding kept in the memory) or "off".
        adaptive_optimizer: what tensors an adaptive optimizer (Adam, AdamW, RMSprop, ...:
            anything but SGD) steps are sent with, where this compressor lists
            ``adaptive_codecs``: one of them by name, "same" (this compressor's codec) or "auto"
            (the policy's). Default: the registry's ``adaptive_family`` ("auto" for 1-bit), else
            "same".
        route: a flat hook's state (``onebit``, ``int8``, ``int4``) on whole nodes of several
            ranks: "auto" may take the hierarchical route (an exact node sum, then the nodes
            exchange: the policy says where), "flat" keeps every rank in the exchange. Default:
            the registry's (``Cost.route``). ``ciuicflow.register`` refuses it for a hierarchical
            hook, ``ciuicflow.fsdp`` always (neither would take it).
    """

    codec: Codec
    adaptive_codecs: dict = {}  # codecs for adaptive optimizers' tensors, by name, if others
    # ... and their error decay where not all of it (docs/decisions.md)
    adaptive_error_decays: dict = {}
    server_codecs: dict = {}  # codecs a server may pack with (``server_codec``), by family name
    option_names = ("chunk_size", "error_decay", "phases", "guard", "guard_threshold",
                    "adaptive_optimizer", "route", "server_codec")
    layout_options = ("chunk_size", "phases")
    default_chunk_size: int
    default_error_decay: float
    default_guard_threshold: float

    def __init__(self, *, chunk_size: int | None = None, error_decay: float | None = None,
                 phases="auto", guard: str = "warn", guard_threshold: float | None = None,
                 adaptive_optimizer: str | None = None, route: str | None = None,
                 server_codec: str = "auto"):
        chunk_size = self.default_chunk_size if chunk_size is None else chunk_size
        error_decay = self.default_error_decay if error_decay is None else error_decay
        granule = self.codec.granule
        if int(chunk_size) <= 0 or int(chunk_size) % granule:
            raise ValueError(f"chunk_size must be a positive multiple of {granule}, got "
                             f"{chunk_size}")
        if not 0.0 <= float(error_decay) <= 1.0:
            raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
        if phases not in ("auto", 1, 2):
            raise ValueError(f"phases must be 1, 2 or 'auto', got {phases!r}")
        if adaptive_optimizer is None:
            adaptive_optimizer = FAMILIES[self.name].cost.adaptive_family or "same"
        allowed = ("auto", *self.adaptive_codecs, "same")
        if adaptive_optimizer not in allowed:
            raise ValueError(f"adaptive_optimizer must be one of {allowed}, "
                             f"got {adaptive_optimizer!r}")
        # asked, not defaulted: a hierarchical hook refuses a route it would ignore
        self.route_asked = route is not None
        if route is None:
            route = FAMILIES[self.name].cost.route
        if route not in ROUTE_POLICIES:
            raise ValueError(f"route must be one of {ROUTE_POLICIES}, got {route!r}")
        if server_codec not in ("auto", "same", *self.server_codecs):
            raise ValueError(f"server_codec must be one of {('auto', 'same', *self.server_codecs)}"
                             f", got {server_codec!r}")
        self.chunk_size, self.error_decay, self.phases = int(chunk_size), float(error_decay), phases
        self.server_codec = server_codec
        self._told_server = False
        self.adaptive_optimizer, self.route = adaptive_optimizer, route
        self._told_adaptive = self._told_route = False
        self._set_guard(guard, self.default_guard_threshold if guard_threshold is None
                        else guard_threshold)

    def new_memory(self) -> QuantizedErrors:
        return QuantizedErrors()

    def wire_plan(self, route, adaptive: bool = False, device=None,
                  hierarchical=None, rung: int = 0) -> policy.WirePlan:
        """What a tensor on ``route`` (None: the reduce-scatter form) sends, an adaptive
        optimizer's (``adaptive``) or not: ``policy.wire_plan`` over this compressor's options;
        ``hierarchical``: the route a flat one may yield to (``route_for``); ``rung``: how far its
        measured noise raised it. ``device`` is the tensor's: the rule is the same on every one."""
        whole = hierarchical is not None and hierarchical is not route \
            and hierarchical.crosses_nodes
        return policy.wire_plan(
            self.name, exchange_ranks=route.exchange_ranks if route is not None else 0,
            route=getattr(route, "name", "flat") if route is not None else "reduce_scatter",
            whole_nodes=whole,
            hierarchical_ranks=hierarchical.exchange_ranks if whole else None,
            adaptive=adaptive, options=self.options(), rung=rung)

    def two_phases(self, route, adaptive: bool = False, device=None) -> bool:
        """Whether an exchange on ``route`` serves segments (each value quantised twice)."""
        return self.wire_plan(route, adaptive, device).phases == 2

    def route_for(self, route, hierarchical, device=None):
        """The route the policy gives a tensor of a flat hook's state: the hierarchical one under
        ``route="auto"`` where the nodes are whole and hold several ranks, else ``route``."""
        if route is hierarchical:
            return route
        plan = self.wire_plan(route, False, device, hierarchical)
        if plan.route != "hierarchical":
            return route
        if not self._told_route:  # once per compressor: why a flat hook's node sum is exact
            self._told_route = True
            log.info("ciuicflow: the flat %s state's buckets go the hierarchical route (an exact "
                     "node sum, then %s between the nodes), not flat; route='flat' keeps them "
                     "flat: docs/hooks.md", self.name, plan.codec)
        return hierarchical

    def codec_for(self, adaptive: bool, route=None, device=None) -> Codec:
        """The codec a tensor on ``device`` is sent with on ``route`` (None: the reduce-scatter
        form): the plan's (``wire_plan``)."""
        return self._codec_named(self.wire_plan(route, adaptive, device).codec, route)

    def own_codec(self, route=None) -> Codec:
        """This compressor's codec on ``route``; a subclass may pick one per route."""
        return self.codec

    def _codec_named(self, name: str, route) -> Codec:
        if name == self.name:
            return self.own_codec(route)
        return self.adaptive_codecs.get(name) or self.server_codecs[name]

    def _pick(self, plan: policy.WirePlan, traffic: Traffic | None,
              route=None) -> tuple[Codec, float]:
        """(codec, error decay) of ``plan``'s workers; a reduction sent with another codec than
        this compressor's own is counted in ``traffic``."""
        codec = self._codec_named(plan.codec, route)
        if plan.codec == self.name:
            return codec, self.error_decay
        if traffic is not None:
            traffic.adaptive_codec_reductions += 1
        if not self._told_adaptive:  # once per compressor: why its ratio is not its own codec's
            self._told_adaptive = True
            ratio = 4 / adaptive_bytes_per_element(codec.name, self.chunk_size)
            hint = ("; ciuicflow.OneBitAdam sends Adam's momentum at 1 bit instead "
                    "(docs/onebit_adam.md)" if self.adaptive_optimizer == "auto" else "")
            log.info("ciuicflow: an adaptive optimizer (Adam, AdamW, ...) steps some of the %s "
                     "state's parameters: their gradients go as %s, not %s (adaptive_optimizer=%r; "
                     "%.1fx fewer bytes than float32): docs/hooks.md, 'Adaptive optimizers'%s",
                     self.name, codec.name, self.name, self.adaptive_optimizer, ratio, hint)
        return codec, self.adaptive_error_decays.get(codec.name, 1.0)

    def _server_codec(self, plan: policy.WirePlan, route) -> Codec | None:
        """The codec the servers of ``plan``'s two phases pack with, where not the workers'."""
        if plan.phases != 2 or plan.server_codec in ("", plan.codec):
            return None
        server = self._codec_named(plan.server_codec, route)
        if not self._told_server:  # once per compressor: why its bytes are not its codec's
            self._told_server = True
            log.info("ciuicflow: %d ranks exchange the %s state's buckets in two phases; the "
                     "servers send each segment's mean as %s, not %s (server_codec=%r; "
                     "'same' keeps %s): docs/hooks.md", plan.exchange_ranks,
                     self.name, server.name, plan.codec, self.server_codec, plan.codec)
        return server

    def step(self, errors: QuantizedErrors, route, exact_mask=None, adaptive: bool = False,
             traffic: Traffic | None = None, device=None, units=None) -> QuantizedStep:
        """One exchange's step for a tensor with memory ``errors``; ``units``: what its optimizer
        divides each coordinate by (None: 1), which the plan may quantise in (``in_units``)."""
        plan = errors.wire_plan = self.wire_plan(route, adaptive, device, rung=errors.rung)
        codec, decay = self._pick(plan, traffic, route)
        server_codec = self._server_codec(plan, route)
        if traffic is not None and not plan.sends_target:
            traffic.beyond_target_reductions += 1
        return QuantizedStep(codec, errors, self.chunk_size, exact_mask, error_decay=decay,
                             server=plan.phases == 2, guard_threshold=self.exact_step_threshold,
                             measure=self.measure, guard_half=self.guard_half,
                             server_codec=server_codec, server_error_decay=None
                             if server_codec is None
                             else self.adaptive_error_decays.get(server_codec.name, 1.0),
                             units=units if plan.in_units else None,
                             fingerprint=plan.in_units)

    def exchange(self, flat, memory, route, context: Context, traffic) -> torch.Tensor:
        step = self.step(memory, route, context.exact_mask, context.adaptive, traffic,
                         flat.device, context.units)
        result = route.reduce(flat, step, traffic, keep=context.keep)
        if step.units is not None:  # the guard measured in the optimizer's units: climb?
            memory.rung, memory.over = policy.climb(memory.wire_plan, memory.rung, memory.over,
                                                    memory.relative_error)
        return result

    # -- the reduce-scatter form (FSDP sharded over every rank) ---------------------------------

    def new_scatter_memory(self) -> ScatterErrors:
        return ScatterErrors()

    def reduce_scatter(self, output: torch.Tensor, rows: torch.Tensor, memory: ScatterErrors,
                       hop, traffic: Traffic | None, scale: float = 1.0,
                       exact_mask: torch.Tensor | None = None,
                       adaptive: bool = False) -> torch.Tensor:
        """``output`` = ``scale`` x the sum over the hop of each rank's row for this rank
        (``quantized_scatter``), with this compressor's codec (``codec_for(adaptive)``), chunk
        size, error decay and guard; ``exact_mask`` (a row's positions) marks those reduced
        exactly."""
        plan = memory.wire_plan = self.wire_plan(None, adaptive, rows.device)
        codec, decay = self._pick(plan, traffic)
        if traffic is not None and not plan.sends_target:
            traffic.beyond_target_reductions += 1
        return quantized_reduce_scatter(codec, memory, output, rows, hop,
                                        chunk_size=self.chunk_size, error_decay=decay,
                                        scale=scale, traffic=traffic, exact_mask=exact_mask,
                                        guard_threshold=self.exact_step_threshold,
                                        measure=self.measure, guard_half=self.guard_half)


def quantized_all_reduce(compressor: QuantizedCompressor, tensor: torch.Tensor,
                         errors: QuantizedErrors, topology=None, *, hierarchical: bool = True,
                         exact_mask: torch.Tensor | None = None,
                         traffic: Traffic | None = None) -> torch.Tensor:
    """Average ``tensor`` in place with ``compressor`` over the topology's group; return it.

    ``hierarchical=True`` quantises only the inter-node step of the hierarchical all-reduce (on a
    single node the all-reduce is then exact); ``False`` quantises all traffic, flat over the
    group. ``errors`` persists between calls for the same tensor. ``exact_mask`` (bool, same
    numel) marks positions reduced exactly. ``traffic`` accumulates the bytes sent."""
    check_reducible(tensor)
    if exact_mask is not None and (exact_mask.dtype != torch.bool
                                   or exact_mask.numel() != tensor.numel()):
        raise ValueError("exact_mask must be a bool tensor with as many elements as the tensor")
    topology = topology if topology is not None else Topology.detect()
    route = (HierarchicalRoute if hierarchical else FlatRoute)(topology)
    flat = tensor.view(-1)
    route.add_exact(traffic, flat)
    compressor.exchange(flat, errors, route, Context(exact_mask=exact_mask), traffic)
    return tensor
