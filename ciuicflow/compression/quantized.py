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
from ciuicflow.compression.registry import ADAPTIVE_AUTO, ADAPTIVE_OPTIMIZER_POLICIES, FAMILIES, \
    ROUTE_POLICIES, adaptive_bytes_per_element, adaptive_codec_name, served_codec_family
from ciuicflow.compression.registry import two_phases as registry_two_phases
from ciuicflow.topology import Topology

log = logging.getLogger("ciuicflow.compression")

__all__ = ["Codec", "QuantizedCompressor", "QuantizedErrors", "QuantizedStep", "native_ops",
           "quantized_all_reduce"]


class QuantizedCompressor(Compressor):
    """Base of the quantising compressors: a subclass sets ``name``, ``codec`` and its defaults.

    Options:
        chunk_size: elements that share one scale (a positive multiple of the codec's granule).
        error_decay: share of the error-feedback memory carried into the next step, in [0, 1]
            (1: classic error feedback).
        phases: 2 (each rank serves a segment and quantises its mean again: 2(W-1)/W of the packed
            bytes), 1 (every rank gathers every packed tensor: (W-1)), or "auto": 1 when the
            exchange has two ranks (the same bytes, without the server's second quantisation);
            for 1 bit's own codec up to four ranks (``registry.ONE_PHASE_RANKS``: the second
            quantisation cost up to 1.5 points on three and four nodes); for an adaptive
            optimizer's tensors under ``adaptive_optimizer="auto"`` where that saves a third of
            two phases' bytes (3 ranks: ``two_phases``); else 2.
        server_codec: what the servers of a two-phase exchange that ``phases="auto"`` picks for
            this compressor's own codec (beyond ``one_phase_ranks``) pack each segment's mean
            with: "auto" (the default) the registry's ``server_family`` (1 bit: int4, whose error
            is small; the second 1-bit quantisation cost a point on eight nodes:
            ``registry.SERVER_FAMILY``), "same" this compressor's codec, or one of its
            ``server_codecs`` by name (1 bit: "int4"; "onebit_int4", 1 bit with int4 in the tenth
            of the chunks where 1 bit errs most, ``compression.refined``: 1 bit's bytes, about half
            a point on the CNN on eight nodes where int4 kept a fifth), there and wherever
            ``phases=2`` asks for two phases. With ``phases=2`` "auto" sends the compressor's
            codec from the servers (its bytes, asked for).
        guard: the accuracy guard: "warn" (a RuntimeWarning when a tensor's relative error,
            ||error-feedback memory|| / ||gradient||, exceeds ``guard_threshold``), "exact" (such a
            tensor's next step sends exactly what it would have compressed: its input plus the
            memory, decayed by ``error_decay``), "fp16" (the same step in float16: half the bytes,
            the rounding kept in the memory) or "off".
        adaptive_optimizer: how to send tensors whose parameters an adaptive optimizer (Adam,
            AdamW, RMSprop, ...: anything but SGD) steps, where this compressor's own codec is too
            coarse for them (it lists ``adaptive_codecs``; docs/hooks.md): "topmark"
            (``compression.topmark``: signs, the largest ninth marked, 20x), "int4", "int8" or
            "twobit" (``compression.twobit``: sign and level bit) with that codec, "same" with
            this compressor's own, "auto": topmark where each value is quantised once (a
            one-phase all-reduce exchange: up to 3 ranks; the reduce-scatter) and the tensor is
            on the CPU (its CUDA kernel has not yet run on a GPU), int4 elsewhere (two phases:
            4 ranks or more; CUDA), on the route ``route`` picks. Default: the registry's
            ``adaptive_family`` for this compressor ("auto" for 1-bit), else "same". Ignored
            where ``adaptive_codecs`` is empty.
        route: what a flat hook's state (``onebit``, ``int8``, ``int4``) does, warm-up included,
            where the group's nodes are whole and hold several ranks: "auto" takes the hierarchical
            route (an exact sum inside each node, then the nodes exchange: each value quantised
            once on two nodes where the flat exchange over every rank quantises it twice, and the
            inter-node links carry 1/L of the bytes; ``route_for``), "flat" keeps every rank in
            the exchange (for nodes whose own links are no faster than the network's). Default:
            the registry's (``Cost.route``): "auto" for 1-bit (flat 1 bit ended 0.6 points below
            exact on the CNN over six seeds and below PyTorch's PowerSGD on the wide MLP, the
            hierarchical route within the line on every seed: docs/convergence.md), "flat" for
            int8 and int4 (within the line flat). ``ciuicflow.register`` refuses it for a
            hierarchical hook, ``ciuicflow.fsdp`` always (neither would take it).
    """

    codec: Codec
    adaptive_codecs: dict = {}  # codecs for adaptive optimizers' tensors, by name, if others
    # ... and their error decay: all of it carried for int4 and int8 (their errors are below half
    # a step per element), half for twobit (docs/convergence.md, "2 bits for Adam")
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
        if adaptive_optimizer not in ADAPTIVE_OPTIMIZER_POLICIES:
            raise ValueError(f"adaptive_optimizer must be one of {ADAPTIVE_OPTIMIZER_POLICIES}, "
                             f"got {adaptive_optimizer!r}")
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

    def two_phases(self, route, adaptive: bool = False, device=None) -> bool:
        """Whether an exchange on ``route`` serves segments (two phases: each value quantised
        twice); the reduce-scatter form (``route`` None) quantises once. ``phases="auto"``: one
        phase up to two ranks; for the compressor's own codec up to its registry
        ``one_phase_ranks`` (1 bit: four, ``registry.ONE_PHASE_RANKS``); for an adaptive
        optimizer's tensor (``adaptive``, on ``device``) under ``adaptive_optimizer="auto"`` where
        sending its once-quantised codec to every rank saves a third of the bytes
        (``registry.adaptive_one_phase``: 3 ranks)."""
        if route is None:
            return False
        policy = self.adaptive_optimizer if adaptive and self.adaptive_codecs else None
        return registry_two_phases(self.phases, route.exchange_ranks, FAMILIES[self.name].cost,
                                   policy, self.chunk_size, _device_type(device))

    def adaptive_codec_name(self, route=None, device=None) -> str:
        """The ``adaptive_optimizer`` policy on ``route`` (None: the reduce-scatter form) for
        tensors on ``device``, "auto" resolved (``registry.adaptive_codec_name``)."""
        once = not self.two_phases(route, True, device)
        return adaptive_codec_name(self.adaptive_optimizer, once, _device_type(device))

    def route_for(self, route, hierarchical, device=None):
        """Under ``route="auto"``, a tensor on a flat route takes the hierarchical one where the
        topology has whole nodes of several ranks: after the node sum fewer ranks exchange, so
        each value is quantised at most as often (two nodes: once; flat over four ranks, twice:
        1 bit lost 0.6 points on the CNN, topmark under Adam +2.7% where int4 sent 7.7x and the
        hierarchical topmark 20x; docs/convergence.md) and the inter-node links carry 1/L of the
        bytes."""
        if self.route != "auto" or route is hierarchical or not hierarchical.crosses_nodes \
                or hierarchical.exchange_ranks >= route.exchange_ranks:
            return route
        if not self._told_route:  # once per compressor: why a flat hook's node sum is exact
            self._told_route = True
            log.info("ciuicflow: the flat %s state's buckets go the hierarchical route (an exact "
                     "node sum, then %s between the nodes; %s for an adaptive optimizer's), not "
                     "flat; route='flat' keeps them flat: docs/hooks.md", self.name,
                     self.codec.name, self.adaptive_codec_name(hierarchical, device))
        return hierarchical

    def codec_for(self, adaptive: bool, route=None, device=None) -> Codec:
        """The codec a tensor on ``device`` is sent with: the ``adaptive_optimizer`` one of
        ``adaptive_codecs`` for an adaptive optimizer's parameters (none for "same"), else this
        compressor's own on ``route`` (None: the reduce-scatter form)."""
        name = self.adaptive_codec_name(route, device)
        if adaptive and name in self.adaptive_codecs:
            return self.adaptive_codecs[name]
        return self.own_codec(route)

    def own_codec(self, route=None) -> Codec:
        """This compressor's codec on ``route``; a subclass may pick one per route."""
        return self.codec

    def _pick(self, adaptive: bool, traffic: Traffic | None, route=None,
              device=None) -> tuple[Codec, float]:
        """(codec, error decay) for one reduction; a reduction sent with the adaptive codec is
        counted in ``traffic``."""
        codec = self.codec_for(adaptive, route, device)
        if codec is self.own_codec(route):
            return codec, self.error_decay
        if traffic is not None:
            traffic.adaptive_codec_reductions += 1
        name = codec.name
        if not self._told_adaptive:  # once per compressor: why its ratio is not 1-bit's
            self._told_adaptive = True
            ratio = 4 / adaptive_bytes_per_element(name, self.chunk_size)
            # where "auto" falls to int4 (four or more exchanging ranks, or GPUs), 1-bit Adam
            # compresses Adam's momentum at 1 bit and held AdamW's loss on up to six nodes
            # (docs/onebit_adam.md)
            hint = ("; ciuicflow.OneBitAdam sends Adam's momentum at 1 bit instead "
                    "(docs/onebit_adam.md)" if self.adaptive_optimizer == "auto"
                    and name == ADAPTIVE_AUTO[1] else "")
            log.info("ciuicflow: an adaptive optimizer (Adam, AdamW, ...) steps some of the %s "
                     "state's parameters: their gradients go as %s, not %s (adaptive_optimizer=%r; "
                     "%.1fx fewer bytes than float32): docs/hooks.md, 'Adaptive optimizers'%s",
                     self.name, name, self.name, self.adaptive_optimizer, ratio, hint)
        return codec, self.adaptive_error_decays.get(name, 1.0)

    def chunk_for(self, codec: Codec) -> int:
        """Elements per chunk with ``codec``: its own where it has one (topmark's 512), else
        ``chunk_size``."""
        return codec.chunk_size or self.chunk_size

    def server_codec_for(self, codec: Codec, route) -> Codec | None:
        """What the servers of a two-phase exchange of ``codec`` on ``route`` pack with, where not
        ``codec`` itself (None), for this compressor's own codec: with ``server_codec="auto"``
        the ``server_family``'s codec where ``phases="auto"`` picked two phases (beyond
        ``one_phase_ranks``); a codec named by ``server_codec`` there, and wherever ``phases=2``
        asks for two phases."""
        if route is None or codec is not self.own_codec(route):
            return None
        family = served_codec_family(self.phases, self.server_codec, FAMILIES[self.name].cost,
                                     route.exchange_ranks)
        if not family:
            return None
        server = self.server_codecs[family]
        if not self._told_server:  # once per compressor: why its bytes are not 1 bit's
            self._told_server = True
            log.info("ciuicflow: %d ranks exchange the %s state's buckets in two phases; the "
                     "servers send each segment's mean as %s, not %s (server_codec=%r; "
                     "'same' keeps %s): docs/hooks.md", route.exchange_ranks,
                     self.name, server.name, codec.name, self.server_codec, codec.name)
        return server

    def step(self, errors: QuantizedErrors, route, exact_mask=None, adaptive: bool = False,
             traffic: Traffic | None = None, device=None) -> QuantizedStep:
        codec, decay = self._pick(adaptive, traffic, route, device)
        server = self.two_phases(route, adaptive, device)
        server_codec = self.server_codec_for(codec, route) if server else None
        return QuantizedStep(codec, errors, self.chunk_for(codec), exact_mask, error_decay=decay,
                             server=server, guard_threshold=self.exact_step_threshold,
                             measure=self.measure, guard_half=self.guard_half,
                             server_codec=server_codec, server_error_decay=None
                             if server_codec is None
                             else self.adaptive_error_decays.get(server_codec.name, 1.0))

    def exchange(self, flat, memory, route, context: Context, traffic) -> torch.Tensor:
        return route.reduce(flat, self.step(memory, route, context.exact_mask, context.adaptive,
                                            traffic, flat.device), traffic, keep=context.keep)

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
        codec, decay = self._pick(adaptive, traffic, device=rows.device)
        return quantized_reduce_scatter(codec, memory, output, rows, hop,
                                        chunk_size=self.chunk_for(codec), error_decay=decay,
                                        scale=scale, traffic=traffic, exact_mask=exact_mask,
                                        guard_threshold=self.exact_step_threshold,
                                        measure=self.measure, guard_half=self.guard_half)


def _device_type(device) -> str | None:
    return None if device is None else torch.device(device).type


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
