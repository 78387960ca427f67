"""FSDP2 sharded inside each node (G ranks), replicated across N nodes: what a step sends.

Per parameter group of B bytes of parameters and gradients: two all-gathers of the parameters inside
the node (forward, and again in backward: FSDP2 reshards after forward), a reduce-scatter of the
gradients inside the node, then each rank's shard (B/G) reduced with the ranks holding the same shard
on the other nodes: FSDP2's own all-reduce (``fsdp_hsdp``) or a method of the registry
(``fsdp_hierarchical_1bit``, ...). The G inter-node groups run at once and share each node's link.
Compression works on the shard only, so its local work is 1/G of DDP's.
"""
from __future__ import annotations

from dataclasses import asdict

from ciuicflow.plan.alpha_beta import _ring_allreduce, _scatter_or_gather
from ciuicflow.plan.inputs import Workload, powersgd_elements
from ciuicflow.plan.methods import cost


def fsdp_terms(strategy, c, w, workload, rank, buckets, parts) -> tuple:
    """(seconds, inter bytes per node, intra bytes per GPU, local compression seconds) of one
    parameter group of ``w.params`` parameters (the planner's bucket)."""
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
        chunk = w.chunk_size or method.chunk_size
        per_elem = method.payload_bits / 8 + 4 / chunk
        phase = _scatter_or_gather(n, shard * per_elem, inter_bw, c.inter_latency)
        compress = shard * w.local_seconds_per_element
        parts.update(inter_all_to_all=phase, inter_all_gather=phase, compress=compress)
        return 3 * gather + 2 * phase, 2 * (n - 1) / n * w.params * per_elem, intra, compress
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
