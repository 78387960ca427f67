"""The alpha-beta cost model: an ``Estimate`` per strategy, the ranking, and the recommendation."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ciuicflow.plan.alpha_beta import _ring_allreduce, _scatter_or_gather
from ciuicflow.plan.fsdp_model import fsdp_terms
from ciuicflow.plan.inputs import ClusterSpec, Workload, powersgd_elements
from ciuicflow.plan.methods import ALL_STRATEGIES, EXACT_STRATEGIES, FSDP_STRATEGIES, POWERSGD_RANK, \
    RANKED, STRATEGIES, cost, default_rank, hierarchical
from ciuicflow.plan.wire_cost import flat_all_to_all, flat_ring, one_phase, \
    packed_bytes_per_element, quantized_exchange, served_bytes_per_element

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




def _hierarchical(c: ClusterSpec, nbytes: float, parts=None, tag="") -> tuple:
    """Intra reduce-scatter, inter all-reduce of the shards (G groups sharing each node's link), intra
    all-gather. Returns (seconds, inter bytes per node, intra bytes per GPU)."""
    g, n = c.gpus_per_node, c.nodes
    if n == 1 or g == 1:  # one level only: the flat ring is the hierarchical algorithm
        return flat_ring(c, nbytes)
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
        comm, inter, intra, compress = fsdp_terms(strategy, c, w, workload, rank, buckets, parts)
    elif strategy == "flat_ring":
        comm, inter, intra = flat_ring(c, nbytes)
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














def _quantized(c: ClusterSpec, w: Workload, method_cost, hierarchical: bool, parts: dict) -> tuple:
    """A quantising method (1-bit, int8): the exchange of compression.quantized (``wire_cost.quantized_exchange``)."""
    g, n, p = c.gpus_per_node, c.nodes, c.world
    elems = w.params
    per_elem = packed_bytes_per_element(method_cost, w, values=True,
                                         exchange_ranks=n if hierarchical and g > 1 else p)
    if hierarchical and n > 1 and g > 1:
        nbytes = elems * w.grad_bytes
        rs = _scatter_or_gather(g, nbytes, c.intra_bw, c.intra_latency)
        shard = elems / g
        # the compressed shard's exchange among N nodes; G groups share the link
        parts.update(intra_reduce_scatter=rs, intra_all_gather=rs)
        exchange, sent = quantized_exchange(n, shard * per_elem, c.inter_goodput / g, c.inter_latency,
                                   one_phase(method_cost, w, n), parts, served=shard *
                                   served_bytes_per_element(method_cost, w, n, per_elem))
        compress = elems * w.local_seconds_per_element
        parts["compress"] = compress
        intra = 2 * (g - 1) / g * nbytes
        return 2 * rs + exchange, sent * g, intra, compress
    if hierarchical and n == 1:  # nothing crosses a node: exact
        comm, inter, intra = flat_ring(c, elems * w.grad_bytes)
        parts["ring"] = comm
        return comm, inter, intra, 0.0
    dc = elems * per_elem
    compress = elems * w.local_seconds_per_element
    # a ring all-gather over all p ranks (as gloo and NCCL run it): one edge per node crosses
    ring_bw = min(c.inter_goodput, c.intra_bw) if n > 1 else c.intra_bw
    ring_lat = c.inter_latency if n > 1 else c.intra_latency
    if one_phase(method_cost, w, p):  # every rank all-gathers every packed tensor
        ag = _scatter_or_gather(p, p * dc, ring_bw, ring_lat)
        parts.update(all_gather=ag, compress=compress)
        return ag, (p - 1) * dc if n > 1 else 0.0, (p - 1) * dc * (g - 1) / g, compress
    # flat over all p ranks in two phases. Phase 1, pairwise all-to-all of the compressed tensor
    a2a, a2a_inter, a2a_intra = flat_all_to_all(c, dc)
    # phase 2, ring all-gather of the served segments (as the servers pack them)
    served = elems * served_bytes_per_element(method_cost, w, p, per_elem)
    ag = _scatter_or_gather(p, served, ring_bw, ring_lat)
    parts.update(all_to_all=a2a, all_gather=ag, compress=compress)
    ag_inter = (p - 1) / p * served if n > 1 else 0.0
    return a2a + ag, a2a_inter + ag_inter, a2a_intra + (p - 1) / p * served * (g - 1) / g, compress




def _powersgd(c: ClusterSpec, w: Workload, rank: int, elements, hierarchical: bool, parts: dict) -> tuple:
    p_elems, q_elems, exact, compressed = elements
    # two all-reduces: P with the uncompressed values, then Q (in the gradients' dtype)
    first = (p_elems + exact) * w.grad_bytes
    second = q_elems * w.grad_bytes
    if hierarchical and c.nodes > 1:
        t1, i1, a1 = _hierarchical(c, first, parts=parts, tag="P_")
        t2, i2, a2 = _hierarchical(c, second, parts=parts, tag="Q_")
    else:
        t1, i1, a1 = flat_ring(c, first)
        t2, i2, a2 = flat_ring(c, second)
        parts.update(P_ring=t1, Q_ring=t2)
    # every rank multiplies its whole gradient: P = M Q, Q = M^T P, M ~ P Q^T (2 r flops/element each),
    # plus element-wise work (M + error, non-finite check, copy out, new error)
    compress = 6 * rank * compressed / w.matmul_flops + w.params * w.local_seconds_per_element
    parts["compress"] = compress
    return t1 + t2, i1 + i2, a1 + a2, compress


def plan(cluster: ClusterSpec, workload: Workload, strategies=None, ranks=None) -> list:
    """Estimates of every strategy (PowerSGD ones at each rank in ``ranks``, default PowerSGD's own
    default rank for the workload's optimizer: lower ranks cost less but lost accuracy in
    bench/convergence), fastest first."""
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
                f"bench/convergence's MLP with momentum SGD rank 1 reached 0.29-0.40 accuracy and "
                f"rank 4 0.78 against exact 0.84 (docs/history/convergence-notebook.md)")
    return best, why

