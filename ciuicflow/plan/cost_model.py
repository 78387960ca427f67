"""The alpha-beta cost model: an ``Estimate`` per strategy, the ranking, and the recommendation."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ciuicflow.compression import registry
from ciuicflow.plan.alpha_beta import _ring_allreduce, _scatter_or_gather
from ciuicflow.plan.inputs import ClusterSpec, Workload, powersgd_elements
from ciuicflow.plan.methods import ALL_STRATEGIES, EXACT_STRATEGIES, FSDP_STRATEGIES, POWERSGD_RANK, \
    RANKED, STRATEGIES, cost, default_rank, hierarchical

@dataclass
class Estimate:
    strategy: str
    rank: int | None
    comm_seconds: float
    step_seconds: float
    compute_seconds: float
    inter_node_bytes_per_node: float  # sent by each node on its inter-node link per step
    intra_node_bytes_per_gpu: float  # sent by each GPU to GPUs of its own node per step
    inter_node_bytes_total: float
    compress_seconds: float = 0.0
    parts: dict = field(default_factory=dict)  # seconds of each phase, all buckets
    buckets: int = 1

    @property
    def name(self) -> str:
        return f"{self.strategy}_r{self.rank}" if self.rank is not None else self.strategy

    def as_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


def _flat_ring(c: ClusterSpec, nbytes: float) -> tuple:
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


def _hierarchical(c: ClusterSpec, nbytes: float, parts=None, tag="") -> tuple:
    """Intra reduce-scatter, inter all-reduce of the shards (G groups sharing each node's link), intra
    all-gather. Returns (seconds, inter bytes per node, intra bytes per GPU)."""
    g, n = c.gpus_per_node, c.nodes
    if n == 1 or g == 1:  # one level only: the flat ring is the hierarchical algorithm
        return _flat_ring(c, nbytes)
    rs = _scatter_or_gather(g, nbytes, c.intra_bw, c.intra_latency)
    inter = _ring_allreduce(n, nbytes / g, c.inter_goodput / g, c.inter_latency)
    ag = rs
    if parts is not None:
        parts.update({f"{tag}intra_reduce_scatter": rs, f"{tag}inter_allreduce": inter, f"{tag}intra_all_gather": ag})
    return rs + inter + ag, 2 * (n - 1) / n * nbytes, 2 * (g - 1) / g * nbytes


def estimate(strategy: str, cluster: ClusterSpec, workload: Workload, rank: int | None = None) -> Estimate:
    """Predicted communication and step time of one strategy (rank: PowerSGD's, for the ranked ones)."""
    if strategy not in ALL_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {ALL_STRATEGIES}")
    if strategy in RANKED:
        rank = int(rank or default_rank(workload.optimizer))
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
    else:
        rank = None
    c = cluster
    # DDP reduces the gradient bucket by bucket, one after the other: model one bucket, count it `buckets` times
    buckets = workload.buckets
    w = Workload(**{**asdict(workload), "params": workload.params / buckets, "bucket_bytes": math.inf,
                    "hidden": workload.hidden_size})
    n, p = c.nodes, c.world
    nbytes = w.params * w.grad_bytes
    parts: dict = {}
    compress = 0.0
    if p == 1:
        comm, inter, intra = 0.0, 0.0, 0.0
    elif strategy in FSDP_STRATEGIES:
        from ciuicflow.plan.fsdp_model import fsdp_terms
        comm, inter, intra, compress = fsdp_terms(strategy, c, w, workload, rank, buckets, parts)
    elif strategy == "flat_ring":
        comm, inter, intra = _flat_ring(c, nbytes)
        parts["ring"] = comm
    elif strategy == "hierarchical":
        comm, inter, intra = _hierarchical(c, nbytes, parts=parts)
    elif cost(strategy).kind == "quantized":
        comm, inter, intra, compress = _quantized(c, w, cost(strategy), hierarchical(strategy), parts)
    else:
        # each bucket holds its share of the matrices
        elements = [e / buckets for e in powersgd_elements(workload, rank)]
        comm, inter, intra, compress = _powersgd(c, w, rank, elements, hierarchical(strategy), parts)
    comm = (comm + compress) * buckets
    inter, intra, compress = inter * buckets, intra * buckets, compress * buckets
    parts = {k: v * buckets for k, v in parts.items()}
    compute = w.accum * w.compute_seconds
    hidden = min(comm, w.overlap * compute * 2 / 3 / w.accum)  # only the last micro-batch's backward overlaps
    return Estimate(strategy, rank, comm, compute + comm - hidden, compute, inter, intra, inter * n, compress,
                    parts, buckets)


def _packed_bytes_per_element(method_cost, w: Workload, values: bool = False,
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
    if not _sends_own_codec(method_cost, w):
        # the planner's gradients are on GPUs: "auto" sends int4 there until topmark's CUDA
        # kernel has run on one (registry.ADAPTIVE_CODEC_DEVICES), in two phases beyond two ranks
        # (registry.adaptive_one_phase: one phase only where topmark is sent)
        once = exchange_ranks is None or not _two_phases(method_cost, w, exchange_ranks)
        policy = registry.adaptive_codec_name(policy, once, "cuda")
        if policy != "same":
            return registry.adaptive_bytes_per_element(policy, chunk)
    if values and method_cost.values and chunk <= registry.VALUES_MAX_CHUNK:
        return bits / 8 + (4 + 3 * method_cost.values * w.values_share) / chunk
    return bits / 8 + 4 / chunk


def _sends_own_codec(method_cost, w: Workload) -> bool:
    """Whether a quantising method sends the workload's gradients with its own codec (not, under
    Adam, with the one its ``adaptive_optimizer`` policy picks)."""
    policy = w.adaptive_optimizer or method_cost.adaptive_family
    return not (w.optimizer == "adam" and method_cost.adaptive_family and policy != "same")


def _two_phases(method_cost, w: Workload, ranks: int) -> bool:
    """Whether the exchange over ``ranks`` ranks has two phases for ``Workload.phases``
    (registry.two_phases, the compressors' rule: "auto" takes the method's own codec in one phase
    up to its ``one_phase_ranks``; an adaptive optimizer's codec on the planner's GPUs, int4, goes
    in two)."""
    policy = None if _sends_own_codec(method_cost, w) else \
        (w.adaptive_optimizer or method_cost.adaptive_family)
    return registry.two_phases(w.phases, ranks, method_cost, policy,
                               w.chunk_size or method_cost.chunk_size, "cuda")


def _one_phase(method_cost, w: Workload, ranks: int) -> bool:
    """Whether the exchange over ``ranks`` (> 2) ranks goes in one phase (``_two_phases``). Two
    ranks are modelled as two phases either way: the same bytes, one latency more."""
    return ranks > 2 and not _two_phases(method_cost, w, ranks)


def _served_bytes_per_element(method_cost, w: Workload, ranks: int, per_elem: float) -> float:
    """Bytes per element the servers of a two-phase exchange over ``ranks`` ranks send back: what
    ``registry.served_codec_family`` picks for ``Workload.phases`` and ``Workload.server_codec``
    (QuantizedCompressor.server_codec_for: beyond four ranks 1 bit's servers send int4), else what
    the workers sent (``per_elem``)."""
    if not _sends_own_codec(method_cost, w) or not _two_phases(method_cost, w, ranks):
        return per_elem
    family = registry.served_codec_family(w.phases, w.server_codec or "auto", method_cost, ranks)
    if not family:
        return per_elem
    return registry.served_bytes_per_element(family, w.chunk_size or method_cost.chunk_size)


def _exchange(ranks: int, nbytes: float, bw: float, lat: float, one_phase: bool, parts: dict,
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


def _quantized(c: ClusterSpec, w: Workload, method_cost, hierarchical: bool, parts: dict) -> tuple:
    """A quantising method (1-bit, int8): the exchange of compression.quantized (``_exchange``)."""
    g, n, p = c.gpus_per_node, c.nodes, c.world
    elems = w.params
    # a flat state with route="auto" (1-bit's default) takes the hierarchical route on whole
    # nodes of several ranks (QuantizedCompressor.route_for; the planner's nodes are whole); on
    # one node, or one rank per node, it stays flat
    hierarchical = hierarchical or (method_cost.route == "auto" and n > 1 and g > 1)
    per_elem = _packed_bytes_per_element(method_cost, w, values=True,
                                         exchange_ranks=n if hierarchical and g > 1 else p)
    if hierarchical and n > 1 and g > 1:
        nbytes = elems * w.grad_bytes
        rs = _scatter_or_gather(g, nbytes, c.intra_bw, c.intra_latency)
        shard = elems / g
        # the compressed shard's exchange among N nodes; G groups share the link
        parts.update(intra_reduce_scatter=rs, intra_all_gather=rs)
        exchange, sent = _exchange(n, shard * per_elem, c.inter_goodput / g, c.inter_latency,
                                   _one_phase(method_cost, w, n), parts, served=shard *
                                   _served_bytes_per_element(method_cost, w, n, per_elem))
        compress = elems * w.local_seconds_per_element
        parts["compress"] = compress
        intra = 2 * (g - 1) / g * nbytes
        return 2 * rs + exchange, sent * g, intra, compress
    if hierarchical and n == 1:  # nothing crosses a node: exact
        comm, inter, intra = _flat_ring(c, elems * w.grad_bytes)
        parts["ring"] = comm
        return comm, inter, intra, 0.0
    dc = elems * per_elem
    compress = elems * w.local_seconds_per_element
    # a ring all-gather over all p ranks (as gloo and NCCL run it): one edge per node crosses
    ring_bw = min(c.inter_goodput, c.intra_bw) if n > 1 else c.intra_bw
    ring_lat = c.inter_latency if n > 1 else c.intra_latency
    if _one_phase(method_cost, w, p):  # every rank all-gathers every packed tensor
        ag = _scatter_or_gather(p, p * dc, ring_bw, ring_lat)
        parts.update(all_gather=ag, compress=compress)
        return ag, (p - 1) * dc if n > 1 else 0.0, (p - 1) * dc * (g - 1) / g, compress
    # flat over all p ranks in two phases. Phase 1, pairwise all-to-all of the compressed tensor
    a2a, a2a_inter, a2a_intra = _flat_all_to_all(c, dc)
    # phase 2, ring all-gather of the served segments (as the servers pack them)
    served = elems * _served_bytes_per_element(method_cost, w, p, per_elem)
    ag = _scatter_or_gather(p, served, ring_bw, ring_lat)
    parts.update(all_to_all=a2a, all_gather=ag, compress=compress)
    ag_inter = (p - 1) / p * served if n > 1 else 0.0
    return a2a + ag, a2a_inter + ag_inter, a2a_intra + (p - 1) / p * served * (g - 1) / g, compress


def _flat_all_to_all(c: ClusterSpec, nbytes: float) -> tuple:
    """(seconds, inter bytes per node, intra bytes per GPU) of a pairwise all-to-all over all p ranks of
    ``nbytes`` per rank: each rank sends (p-1)/p of it, the off-node share (p-G)/(p-1) of that over its
    node's link (G ranks' worth per node), the rest inside the node."""
    g, n, p = c.gpus_per_node, c.nodes, c.world
    inter = g * (p - g) / p * nbytes
    lat = (p - 1) * (c.inter_latency if n > 1 else c.intra_latency)
    seconds = lat + max(inter / c.inter_goodput if n > 1 else 0.0, (g - 1) / p * nbytes / c.intra_bw)
    return seconds, inter, (g - 1) / p * nbytes


def _powersgd(c: ClusterSpec, w: Workload, rank: int, elements, hierarchical: bool, parts: dict) -> tuple:
    p_elems, q_elems, exact, compressed = elements
    # two all-reduces: P with the uncompressed values, then Q (in the gradients' dtype)
    first = (p_elems + exact) * w.grad_bytes
    second = q_elems * w.grad_bytes
    if hierarchical and c.nodes > 1:
        t1, i1, a1 = _hierarchical(c, first, parts=parts, tag="P_")
        t2, i2, a2 = _hierarchical(c, second, parts=parts, tag="Q_")
    else:
        t1, i1, a1 = _flat_ring(c, first)
        t2, i2, a2 = _flat_ring(c, second)
        parts.update(P_ring=t1, Q_ring=t2)
    # every rank multiplies its whole gradient: P = M Q, Q = M^T P, M ~ P Q^T (2 r flops/element each),
    # plus element-wise work (M + error, non-finite check, copy out, new error)
    compress = 6 * rank * compressed / w.matmul_flops + w.params * w.local_seconds_per_element
    parts["compress"] = compress
    return t1 + t2, i1 + i2, a1 + a2, compress


def plan(cluster: ClusterSpec, workload: Workload, strategies=None, ranks=None) -> list:
    """Estimates of every strategy (PowerSGD ones at each rank in ``ranks``, default PowerSGD's own
    default rank for the workload's optimizer: lower ranks cost less but lost accuracy in
    bench/convergence.py), fastest first."""
    out = []
    for s in strategies or STRATEGIES:
        for r in ((ranks or (default_rank(workload.optimizer),)) if s in RANKED else (None,)):
            out.append(estimate(s, cluster, workload, r))
    return sorted(out, key=lambda e: e.step_seconds)


def recommend(estimates) -> tuple:
    """(the Estimate to use, why). Exact strategies win unless compression saves at least 10% of the step."""
    best = min(estimates, key=lambda e: e.step_seconds)
    exact = [e for e in estimates if e.strategy in EXACT_STRATEGIES]
    best_exact = min(exact, key=lambda e: e.step_seconds) if exact else None
    if best is best_exact:
        return best, "fastest, and exact"
    if best_exact is None:  # --strategies left out every exact one
        return best, ("fastest of the strategies asked for, none of them exact; compression "
                      "changes the update: check accuracy on your model")
    if best.step_seconds >= 0.9 * best_exact.step_seconds:
        return best_exact, (f"exact, within 10% of the fastest ({best.name}, "
                            f"{best.step_seconds / best_exact.step_seconds:.2f}x its step time)")
    why = (f"{best_exact.step_seconds / best.step_seconds:.2f}x faster per step than the best exact "
           f"strategy ({best_exact.name}); compression changes the update: error feedback keeps it "
           f"converging, but check accuracy on your model")
    if best.rank is not None and best.rank < POWERSGD_RANK:
        why += (f". Rank {best.rank} is below PowerSGD's default ({POWERSGD_RANK}): on "
                f"bench/convergence.py's MLP with momentum SGD rank 1 reached 0.29-0.40 accuracy and "
                f"rank 4 0.78 against exact 0.84 (docs/convergence.md)")
    return best, why

