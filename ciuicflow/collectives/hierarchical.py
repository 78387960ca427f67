"""Hierarchical all-reduce: intra-node reduce-scatter -> inter-node step -> intra-node all-gather.

After the reduce-scatter, local rank ``i`` of every node holds slice ``i`` of its node's sum; the
ranks that share local rank ``i`` (one per node) then combine their slices over the inter-node
group, and the all-gather spreads the result back inside each node. Inter-node links carry 1/L of
what a flat all-reduce puts on them (L ranks per node).

The inter-node step is pluggable: an exact all-reduce here, 1-bit (``onebit.OneBitStep``) or
anything else that takes a shard and returns its mean over the inter-node group. A step is called
as ``step(shard, link, flag, offset, traffic)``, where ``offset`` is where the shard starts in the
flattened tensor, and ``flag`` (for steps with ``needs_flag``) is a one-element tensor, nonzero
when the node's sum holds a non-finite value anywhere, the same on every rank of the node, so
compressed steps can agree on an exact fallback.

The node sum depends on the backend. NCCL (CUDA tensors): a reduce-scatter, as above. Gloo (CPU
tensors): gloo's reduce-scatter is slower than its all-reduce of the whole tensor (77 ms against 40
ms for 26 MB on 2 ranks here), so the node all-reduces the whole tensor and each local rank takes its
shard from the sum; intra-node links then carry twice the bytes, inter-node links the same.

Buffers of any length work: shards are padded to equal length, and trimmed on the way back.
When the topology has one rank per node, or uneven nodes, the step runs once over the whole group
(flat); on a single node the all-reduce is exact, as nothing crosses a node boundary.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ciuicflow.collectives import Link, Traffic, add_traffic, all_gather, all_reduce, \
    reduce_scatter, ring_all_reduce_bytes, shm
from ciuicflow.topology import Topology

_OPS = ("mean", "sum")
NODE_SUM_ENV = "CIUICFLOW_NODE_SUM"
_NODE_SUMS = ("shared_memory", "all_reduce", "reduce_scatter")


class ExactStep:
    """The plain inter-node step: an exact mean over the inter-node group."""

    needs_flag = False

    def __call__(self, x, link, flag, offset, traffic):
        x.div_(link.size)
        return all_reduce(x, link, traffic)


EXACT = ExactStep()


def hierarchical_all_reduce(tensor: torch.Tensor, topology: Topology | None = None, *,
                            op: str = "mean", inter_node=None,
                            traffic: Traffic | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the topology's group and return it.

    ``op`` is ``"mean"`` or ``"sum"``. ``inter_node`` is the inter-node step (default: exact).
    ``traffic`` (a ``Traffic``) accumulates the bytes sent, and the bytes an exact all-reduce along
    the same path sends. Every rank of the group must call this with tensors of the same size.
    """
    check_reducible(tensor)
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    topology = topology if topology is not None else Topology.detect()
    if traffic is not None:
        add_exact_traffic(traffic, tensor, topology)
    reduce_in_place(tensor.view(-1), topology, op, inter_node or EXACT, traffic)
    return tensor


def flat_all_reduce(tensor: torch.Tensor, topology: Topology | None = None, *, op: str = "mean",
                    traffic: Traffic | None = None) -> torch.Tensor:
    """Exact all-reduce of ``tensor`` in place over the whole group, ignoring nodes; return it."""
    check_reducible(tensor)
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    topology = topology if topology is not None else Topology.detect()
    if topology.world_size == 1 or tensor.numel() == 0:
        return tensor
    link = Link.flat(topology)
    if traffic is not None:
        traffic.add_exact(link, ring_all_reduce_bytes(tensor.numel() * tensor.element_size(),
                                                      link.size))
    if op == "mean":
        tensor.div_(link.size)
    all_reduce(tensor.view(-1), link, traffic)
    return tensor


def check_reducible(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous (it is reduced in place)")


def add_exact_traffic(traffic: Traffic, tensor: torch.Tensor, topology: Topology) -> None:
    """Count what an exact all-reduce of ``tensor`` along the hierarchical path sends."""
    numel, itemsize = tensor.numel(), tensor.element_size()
    nbytes = numel * itemsize
    if topology.world_size == 1 or nbytes == 0:
        return
    if topology.hierarchical:  # with the padding to a multiple of L that the algorithm uses
        local = topology.local_world_size
        shard_bytes = -(-numel // local) * itemsize
        node_sum = ring_all_reduce_bytes(nbytes, local) \
            if node_sum_method(tensor, topology) == "all_reduce" else (local - 1) * shard_bytes
        traffic.add_exact(Link.intra(topology), node_sum + (local - 1) * shard_bytes)
        traffic.add_exact(Link.inter(topology),
                          ring_all_reduce_bytes(shard_bytes, topology.num_nodes))
    else:
        traffic.add_exact(Link.flat(topology), ring_all_reduce_bytes(nbytes, topology.world_size))


def reduce_in_place(flat: torch.Tensor, topology: Topology, op: str, step,
                    traffic: Traffic | None) -> None:
    """The algorithm behind ``hierarchical_all_reduce``, on a 1-D contiguous tensor."""
    numel, world = flat.numel(), topology.world_size
    if world == 1 or numel == 0:
        return
    if topology.num_nodes == 1 or (step is EXACT and not topology.hierarchical):
        if op == "mean":
            flat.div_(world)
        all_reduce(flat, Link.flat(topology), traffic)
        return
    if not topology.hierarchical:  # one rank per node, or uneven nodes: the step spans the group
        result = step(flat, Link.flat(topology), None, 0, traffic)
        if result is not flat:
            flat.copy_(result)
        if op == "sum":
            flat.mul_(world)
        return

    local, nodes = topology.local_world_size, topology.num_nodes
    shard_len = -(-numel // local)
    divide_first = op == "mean" and flat.element_size() < 4  # fp16/bf16 node sums stay in range
    if divide_first:
        flat.div_(local)
    shard_bytes = shard_len * flat.element_size()
    method, segment = node_sum_method(flat, topology), None
    if method == "shared_memory":
        segment = shm.node_segment(topology)
        try:
            shard, flag = segment.node_sum(flat, shard_len, step.needs_flag)
        except shm.Unavailable as exc:  # it could not grow: gloo from now on
            shm.disable(topology, exc)
            segment, method = None, "all_reduce"
        else:  # what the ranks read of each other's slots: a reduce-scatter's worth
            add_traffic(traffic, Link.intra(topology), (local - 1) * shard_bytes)
    if method == "all_reduce":
        shard, flag = _node_sum_by_all_reduce(flat, topology, shard_len, step.needs_flag, traffic)
    elif method == "reduce_scatter":
        shard, flag = _node_sum_by_reduce_scatter(flat, topology, shard_len, step.needs_flag,
                                                  traffic)
    if op == "mean" and not divide_first:
        shard.div_(local)

    if step is EXACT:
        if op == "mean":
            shard.div_(nodes)
        result = all_reduce(shard, Link.inter(topology), traffic)
    else:
        result = step(shard, Link.inter(topology), flag, topology.local_rank * shard_len, traffic)
        if op == "sum":
            result.mul_(nodes)

    if segment is not None:
        if result is not shard:
            shard.copy_(result)
        segment.gather(flat, shard_len)
        add_traffic(traffic, Link.intra(topology), (local - 1) * shard_bytes)
        return
    # The result may be a view of flat (CPU path), which the all-gather overwrites: send a copy.
    if local * shard_len == numel:
        all_gather(flat, result.clone(), Link.intra(topology), traffic)
    else:
        gathered = flat.new_empty(local * shard_len)
        all_gather(gathered, _padded_shard(result, shard_len), Link.intra(topology), traffic)
        flat.copy_(gathered[:numel])


def node_sum_method(tensor: torch.Tensor, topology: Topology) -> str:
    """How the node sum of ``tensor`` is taken: "reduce_scatter" (CUDA tensors, by default),
    "shared_memory" (CPU tensors, where the node's ranks can share memory) or "all_reduce" (CPU
    tensors otherwise). ``CIUICFLOW_NODE_SUM`` forces one of the three."""
    choice = os.environ.get(NODE_SUM_ENV, "auto")
    if choice not in _NODE_SUMS + ("auto",):
        raise ValueError(f"{NODE_SUM_ENV} must be auto or one of {_NODE_SUMS}, got {choice!r}")
    if choice == "auto":
        choice = "shared_memory" if tensor.device.type == "cpu" else "reduce_scatter"
    if choice == "shared_memory" and (tensor.device.type != "cpu"
                                      or shm.node_segment(topology) is None):
        choice = "all_reduce"
    return choice


def _node_sum_by_all_reduce(flat, topology, shard_len, needs_flag, traffic):
    """Gloo (CPU tensors): an all-reduce of the whole tensor costs less than its reduce-scatter
    here, and leaves every local rank the node's sum: take this rank's shard as a view, and the
    node's non-finite flag from the whole sum with no extra collective."""
    all_reduce(flat, Link.intra(topology), traffic)
    start = min(flat.numel(), topology.local_rank * shard_len)
    shard = _padded_shard(flat[start:start + shard_len], shard_len, copy=False)
    return shard, nonfinite_flag(flat) if needs_flag else None


def _node_sum_by_reduce_scatter(flat, topology, shard_len, needs_flag, traffic):
    """NCCL (CUDA tensors): reduce-scatter, then agree on the node's non-finite flag with a
    one-element all-reduce (a shard holds inf/NaN when any rank's input did there)."""
    local = topology.local_world_size
    if shard_len * local == flat.numel():
        staging = flat.view(local, shard_len)
    else:
        staging = flat.new_empty(local, shard_len)
        _fill_rows(staging, flat)
    shard = flat.new_empty(shard_len)
    reduce_scatter(shard, staging.view(-1), Link.intra(topology), traffic)
    if not needs_flag:
        return shard, None
    flag = nonfinite_flag(shard)
    dist.all_reduce(flag, group=topology.intra_group)  # 4 bytes: not counted as traffic
    return shard, flag


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A one-element float32 tensor, 1 when ``tensor`` holds inf or NaN, else 0.

    One float32 sum: it is non-finite exactly when an element is, or when finite values add up
    past float32's range (a false alarm that only makes a step exact). Far cheaper than
    ``isfinite(t).any()``, which materialises a mask of the whole tensor.
    """
    total = tensor.sum(dtype=torch.float32)  # 0 for an empty tensor
    return (~torch.isfinite(total)).to(torch.float32).view(1)


def _padded_shard(result: torch.Tensor, shard_len: int, copy: bool = True) -> torch.Tensor:
    """``result`` zero-padded to ``shard_len`` elements: a new tensor, or itself if it has the
    length already and ``copy`` is false."""
    if result.numel() == shard_len:
        return result.clone() if copy else result
    out = result.new_zeros(shard_len)
    out[:result.numel()] = result
    return out


def _fill_rows(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """Copy ``flat`` row by row into ``rows`` [L, s] (possibly strided) and zero the rest."""
    shard_len = rows.shape[1]
    full, rest = divmod(flat.numel(), shard_len)
    rows[:full].copy_(flat[:full * shard_len].view(full, shard_len))
    if rest:
        rows[full, :rest].copy_(flat[full * shard_len:])
        rows[full, rest:].zero_()
        full += 1
    rows[full:].zero_()
