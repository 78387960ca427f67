"""FSDP2 sharded inside each node (G ranks), replicated across N nodes (HSDP), or sharded over all
p = N G ranks (a 1-D mesh): what a step sends.

Per parameter group of B bytes of parameters and gradients: two all-gathers of the parameters inside
the node (forward, and again in backward: FSDP2 reshards after forward), a reduce-scatter of the
gradients inside the node, then each rank's shard (B/G) reduced with the ranks holding the same shard
on the other nodes: FSDP2's own all-reduce (``fsdp_hsdp``) or a method of the registry
(``fsdp_hierarchical_1bit``, ...). The G inter-node groups run at once and share each node's link.
Compression works on the shard only, so its local work is 1/G of DDP's.

Over every rank (``fsdp``, ``fsdp_onebit``, ``fsdp_int8``): the two all-gathers and the reduce-scatter
span all p ranks, each a ring in node order (half of the flat ring all-reduce's time and bytes; gloo's
reduce-scatter is a whole all-reduce of its input), or, compressed, the reduce-scatter is one pairwise
all-to-all of the packed rows, each rank's own row kept (compression/quantized_scatter.py); each rank
packs its whole gradient.
"""
from __future__ import annotations

from dataclasses import asdict

from ciuicflow.plan.alpha_beta import _ring_allreduce, _scatter_or_gather
from ciuicflow.plan.inputs import Workload, powersgd_elements
from ciuicflow.plan.methods import ONE_DIM_STRATEGIES, cost
from ciuicflow.plan.wire_cost import flat_all_to_all, flat_ring, one_phase, \
    packed_bytes_per_element, quantized_exchange, served_bytes_per_element


def fsdp_terms(strategy, c, w, workload, rank, buckets, parts) -> tuple:
    """(seconds, inter bytes per node, intra bytes per GPU, local compression seconds) of one
    parameter group of ``w.params`` parameters (the planner's bucket)."""
    if strategy in ONE_DIM_STRATEGIES:
        return _one_dim_terms(strategy, c, w, parts)
    g, n = c.gpus_per_node, c.nodes
    nbytes = w.params * w.grad_bytes
    gather = _scatter_or_gather(g, nbytes, c.intra_bw, c.intra_latency)
    parts.update(param_all_gather=2 * gather, grad_reduce_scatter=gather)
    intra = 3 * (g - 1) / g * nbytes
    shard = w.params / g
    inter_bw = c.inter_goodput / g
    if strategy == "fsdp_hsdp" or n == 1:
        seconds = _ring_allreduce(n, shard * w.grad_bytes, inter_bw, c.inter_latency)
        parts["inter_allreduce"] = seconds
        return 3 * gather + seconds, 2 * (n - 1) / n * nbytes, intra, 0.0
    method = cost(strategy)
    if method.kind == "quantized":
        # the replicas' all-reduce (one rank per node) sends the values
        per_elem = packed_bytes_per_element(method, w, values=True, exchange_ranks=n)
        exchange, sent = quantized_exchange(n, shard * per_elem, inter_bw, c.inter_latency,
                                   one_phase(method, w, n), parts,
                                   served=shard * served_bytes_per_element(method, w, n, per_elem))
        compress = shard * w.local_seconds_per_element
        parts["compress"] = compress
        return 3 * gather + exchange, sent * g, intra, compress
    # low rank: each shard of a matrix is a matrix of rows / G
    shards = Workload(**{**asdict(workload), "params": workload.params / g,
                         "matrix_shapes": [(max(1, r // g), cols) for r, cols in workload.matrix_shapes]
                         if workload.matrix_shapes else None})
    p_elems, q_elems, exact, compressed = (e / buckets for e in powersgd_elements(shards, rank))
    t1 = _ring_allreduce(n, (p_elems + exact) * w.grad_bytes, inter_bw, c.inter_latency)
    t2 = _ring_allreduce(n, q_elems * w.grad_bytes, inter_bw, c.inter_latency)
    compress = 6 * rank * compressed / w.matmul_flops + shard * w.local_seconds_per_element
    parts.update(P_inter_allreduce=t1, Q_inter_allreduce=t2, compress=compress)
    inter = 2 * (n - 1) / n * (p_elems + exact + q_elems) * w.grad_bytes * g
    return 3 * gather + t1 + t2, inter, intra, compress


def _one_dim_terms(strategy, c, w, parts) -> tuple:
    """The terms of ``fsdp_terms`` for FSDP2 over all p ranks."""
    ring, ring_inter, ring_intra = flat_ring(c, w.params * w.grad_bytes)  # = two all-gathers
    parts["param_all_gather"] = ring
    if strategy == ONE_DIM_STRATEGIES[0]:  # FSDP2's own reduce-scatter
        share = 1.0 if c.backend == "gloo" else 0.5  # of the ring all-reduce
        parts["grad_reduce_scatter"] = share * ring
        return (1 + share) * ring, (1 + share) * ring_inter, (1 + share) * ring_intra, 0.0
    a2a, inter, intra = flat_all_to_all(c, w.params * packed_bytes_per_element(cost(strategy), w))
    compress = w.params * w.local_seconds_per_element
    parts.update(grad_all_to_all=a2a, compress=compress)
    return ring + a2a, ring_inter + inter, ring_intra + intra, compress
