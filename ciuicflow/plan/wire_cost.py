"""The bytes and seconds of one exchange: a flat ring, a pairwise all-to-all, and the quantised
exchange of compression.quantized (its codec's bytes per element, one phase or two, what the
servers send back), costed by the plan the compressors take (``compression.policy``). The DDP model
(``cost_model``) and the FSDP model (``fsdp_model``) both build on these."""
from __future__ import annotations

from ciuicflow.compression import policy, registry
from ciuicflow.compression.policy import WirePlan
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


def wire_plan(method_cost, w: Workload, exchange_ranks: int | None) -> WirePlan:
    """The compressors' plan (``compression.policy.wire_plan``) for the workload's gradients over
    ``exchange_ranks`` ranks (None: FSDP's reduce-scatter), with the workload's options. Under an
    adaptive optimizer, the ladder's first rung: where a bucket is raised is known only from its
    measured noise, so a raised bucket costs more than modelled."""
    family = next(name for name, entry in registry.FAMILIES.items() if entry.cost is method_cost)
    # --adaptive-optimizer is the 1-bit states' option; the others keep their default
    asked = w.adaptive_optimizer if method_cost.payload_bits == 1 else ""
    options = {"phases": w.phases, "server_codec": w.server_codec or "auto",
               "adaptive_optimizer": asked or None, "chunk_size": w.chunk_size or None}
    return policy.wire_plan(family, exchange_ranks=exchange_ranks or 0,
                            route="reduce_scatter" if exchange_ranks is None else "flat",
                            adaptive=w.optimizer == "adam", options=options)


def packed_bytes_per_element(method_cost, w: Workload, values: bool = False,
                             exchange_ranks: int | None = None) -> float:
    """A quantising method's bytes per element: its plan's codec (``wire_plan``), one float32
    scale per chunk and, with ``values`` (the all-reduce routes: DDP's hooks, HSDP's replicas),
    the values a chunk of a concentrated window sends (3 bytes each), counted for
    ``Workload.values_share`` of the chunks (default every one: an upper bound, reached where
    every window is concentrated; which windows are is known only from the data).
    ``exchange_ranks``: ranks of the all-reduce exchange (None: the reduce-scatter)."""
    plan = wire_plan(method_cost, w, exchange_ranks)
    chunk = w.chunk_size or method_cost.chunk_size
    if plan.codec != plan.family:
        return registry.adaptive_bytes_per_element(plan.codec, chunk)
    if values and plan.values:
        return method_cost.payload_bits / 8 + (4 + 3 * plan.values * w.values_share) / chunk
    return method_cost.payload_bits / 8 + 4 / chunk


def two_phases(method_cost, w: Workload, ranks: int) -> bool:
    """Whether the exchange over ``ranks`` ranks has two phases (``wire_plan``)."""
    return wire_plan(method_cost, w, ranks).phases == 2


def one_phase(method_cost, w: Workload, ranks: int) -> bool:
    """Whether the exchange over ``ranks`` (> 2) ranks goes in one phase (``two_phases``). Two
    ranks are modelled as two phases either way: the same bytes, one latency more."""
    return ranks > 2 and not two_phases(method_cost, w, ranks)


def served_bytes_per_element(method_cost, w: Workload, ranks: int, per_elem: float) -> float:
    """Bytes per element the servers of a two-phase exchange over ``ranks`` ranks send back: their
    codec in the plan (``wire_plan``) where it is not the workers', else what the workers sent
    (``per_elem``)."""
    plan = wire_plan(method_cost, w, ranks)
    if plan.phases != 2 or plan.server_codec in ("", plan.codec):
        return per_elem
    return registry.served_bytes_per_element(plan.server_codec, w.chunk_size or method_cost.chunk_size)


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
