"""The bytes and seconds of one exchange: a flat ring, a pairwise all-to-all, and the quantised
exchange of compression.quantized (its codec's bytes per element, one phase or two, what the
servers send back), costed by the registry's rules as the compressors apply them. The DDP model
(``cost_model``) and the FSDP model (``fsdp_model``) both build on these."""
from __future__ import annotations

from ciuicflow.compression import registry
from ciuicflow.plan.alpha_beta import _scatter_or_gather
from ciuicflow.plan.inputs import ClusterSpec, Workload


def flat_ring(c: ClusterSpec, nbytes: float) -> tuple:
    """(seconds, inter bytes per node, intra bytes per GPU) of a ring all-reduce over all ranks in node order."""
    p, g, n = c.world, c.gpus_per_node, c.nodes
    if p == 1:
        return 0.0, 0.0, 0.0
    chunk = nbytes / p
    hops = []
    if n > 1:
        hops.append(c.inter_latency + chunk / c.inter_goodput)
    if g > 1:
        hops.append(c.intra_latency + chunk / c.intra_bw)
    seconds = 2 * (p - 1) * max(hops)
    sent = 2 * (p - 1) / p * nbytes
    return seconds, (sent if n > 1 else 0.0), (sent * (g - 1) / g if n > 1 else sent)


def flat_all_to_all(c: ClusterSpec, nbytes: float) -> tuple:
    """(seconds, inter bytes per node, intra bytes per GPU) of a pairwise all-to-all over all p ranks of
    ``nbytes`` per rank: each rank sends (p-1)/p of it, the off-node share (p-G)/(p-1) of that over its
    node's link (G ranks' worth per node), the rest inside the node."""
    g, n, p = c.gpus_per_node, c.nodes, c.world
    inter = g * (p - g) / p * nbytes
    lat = (p - 1) * (c.inter_latency if n > 1 else c.intra_latency)
    seconds = lat + max(inter / c.inter_goodput if n > 1 else 0.0, (g - 1) / p * nbytes / c.intra_bw)
    return seconds, inter, (g - 1) / p * nbytes


def packed_bytes_per_element(method_cost, w: Workload, values: bool = False,
                              exchange_ranks: int | None = None) -> float:
    """A quantising method's bytes per element: the values (under an adaptive optimizer, with the
    codec it sends those gradients with: ``Workload.adaptive_optimizer``), one float32 scale per
    chunk and, with ``values`` (the all-reduce routes: DDP's hooks, HSDP's replicas), the values a
    chunk of a concentrated window sends (``Cost.values``, 3 bytes each, in chunks of at most
    ``registry.VALUES_MAX_CHUNK``), counted for ``Workload.values_share`` of the chunks (default
    every one: an upper bound, reached where every window is concentrated; a gradient with none
    costs the plain bytes; which windows are is known only from the data). ``exchange_ranks``:
    ranks of the all-reduce exchange (None: the reduce-scatter), which "auto" picks the codec by
    (each value quantised once in the reduce-scatter and in a one-phase exchange, up to two ranks)."""
    bits = method_cost.payload_bits
    chunk = w.chunk_size or method_cost.chunk_size
    policy = w.adaptive_optimizer or method_cost.adaptive_family
    if not sends_own_codec(method_cost, w):
        # the planner's gradients are on GPUs: "auto" sends int4 there until topmark's CUDA
        # kernel has run on one (registry.ADAPTIVE_CODEC_DEVICES), in two phases beyond two ranks
        # (registry.adaptive_one_phase: one phase only where topmark is sent)
        once = exchange_ranks is None or not two_phases(method_cost, w, exchange_ranks)
        policy = registry.adaptive_codec_name(policy, once, "cuda")
        if policy != "same":
            return registry.adaptive_bytes_per_element(policy, chunk)
    if values and method_cost.values and chunk <= registry.VALUES_MAX_CHUNK:
        return bits / 8 + (4 + 3 * method_cost.values * w.values_share) / chunk
    return bits / 8 + 4 / chunk


def sends_own_codec(method_cost, w: Workload) -> bool:
    """Whether a quantising method sends the workload's gradients with its own codec (not, under
    Adam, with the one its ``adaptive_optimizer`` policy picks)."""
    policy = w.adaptive_optimizer or method_cost.adaptive_family
    return not (w.optimizer == "adam" and method_cost.adaptive_family and policy != "same")


def two_phases(method_cost, w: Workload, ranks: int) -> bool:
    """Whether the exchange over ``ranks`` ranks has two phases for ``Workload.phases``
    (registry.two_phases, the compressors' rule: "auto" takes the method's own codec in one phase
    up to its ``one_phase_ranks``; an adaptive optimizer's codec on the planner's GPUs, int4, goes
    in two)."""
    policy = None if sends_own_codec(method_cost, w) else \
        (w.adaptive_optimizer or method_cost.adaptive_family)
    return registry.two_phases(w.phases, ranks, method_cost, policy,
                               w.chunk_size or method_cost.chunk_size, "cuda")


def one_phase(method_cost, w: Workload, ranks: int) -> bool:
    """Whether the exchange over ``ranks`` (> 2) ranks goes in one phase (``two_phases``). Two
    ranks are modelled as two phases either way: the same bytes, one latency more."""
    return ranks > 2 and not two_phases(method_cost, w, ranks)


def served_bytes_per_element(method_cost, w: Workload, ranks: int, per_elem: float) -> float:
    """Bytes per element the servers of a two-phase exchange over ``ranks`` ranks send back: what
    ``registry.served_codec_family`` picks for ``Workload.phases`` and ``Workload.server_codec``
    (QuantizedCompressor.server_codec_for: beyond four ranks 1 bit's servers send int4), else what
    the workers sent (``per_elem``)."""
    if not sends_own_codec(method_cost, w) or not two_phases(method_cost, w, ranks):
        return per_elem
    family = registry.served_codec_family(w.phases, w.server_codec or "auto", method_cost, ranks)
    if not family:
        return per_elem
    return registry.served_bytes_per_element(family, w.chunk_size or method_cost.chunk_size)


def quantized_exchange(ranks: int, nbytes: float, bw: float, lat: float, one_phase: bool, parts: dict,
              tag: str = "inter_", served: float | None = None) -> tuple:
    """(seconds, bytes each rank sends) of the quantised exchange of ``nbytes`` packed bytes per
    rank over ``ranks`` ranks: two phases (an all-to-all of 1/ranks each, then an all-gather of
    the servers' ``served`` bytes, default ``nbytes``, 1/ranks each) or one (an all-gather of the
    whole: ranks-1)."""
    if one_phase:
        seconds = _scatter_or_gather(ranks, ranks * nbytes, bw, lat)
        parts[tag + "all_gather"] = seconds
        return seconds, (ranks - 1) * nbytes
    served = nbytes if served is None else served
    scatter = _scatter_or_gather(ranks, nbytes, bw, lat)
    gather = _scatter_or_gather(ranks, served, bw, lat)
    parts.update({tag + "all_to_all": scatter, tag + "all_gather": gather})
    return scatter + gather, (ranks - 1) / ranks * (nbytes + served)
