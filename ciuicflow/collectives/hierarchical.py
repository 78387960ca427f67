"""Hierarchical all-reduce: intra-node reduce-scatter -> inter-node step -> intra-node all-gather.

After the reduce-scatter, local rank ``i`` of every node holds slice ``i`` of its node's sum; the
ranks that share local rank ``i`` (one per node) then combine their slices over the inter-node
group, and the all-gather spreads the result back inside each node. Inter-node links carry 1/L of
what a flat all-reduce puts on them (L ranks per node).

The inter-node step is pluggable: an exact all-reduce here, 1-bit (``onebit.OneBitStep``) or
anything else that takes a shard and returns its mean over the inter-node group. A step is called
as ``step(shard, link, flag, offset, traffic)``, where ``offset`` is where the shard starts in the
flattened tensor, and ``flag`` (for steps with ``needs_flag``) is a one-element tensor counting the
node's ranks that held a non-finite value anywhere in the tensor: it rides in one extra column of
the reduce-scatter, so compressed steps can agree on an exact fallback without another collective.

Buffers of any length work: the tensor is padded to a multiple of L, and trimmed on the way back.
When the topology has one rank per node, or uneven nodes, the step runs once over the whole group
(flat); on a single node the all-reduce is exact, as nothing crosses a node boundary.
"""
from __future__ import annotations

import torch

from ciuicflow.collectives import Link, Traffic, all_gather, all_reduce, reduce_scatter, \
    ring_all_reduce_bytes
from ciuicflow.topology import Topology

_OPS = ("mean", "sum")


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
        add_exact_traffic(traffic, tensor.numel(), tensor.element_size(), topology)
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


def add_exact_traffic(traffic: Traffic, numel: int, itemsize: int, topology: Topology) -> None:
    """Count what an exact all-reduce of ``numel`` elements along the hierarchical path sends."""
    nbytes = numel * itemsize
    if topology.world_size == 1 or nbytes == 0:
        return
    if topology.hierarchical:  # with the padding to a multiple of L that the algorithm uses
        local = topology.local_world_size
        shard_bytes = -(-numel // local) * itemsize
        traffic.add_exact(Link.intra(topology), 2.0 * (local - 1) * shard_bytes)
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
    width = shard_len + 1 if step.needs_flag else shard_len
    if width * local == numel:  # no padding, no flag column: scatter straight from the tensor
        staging = flat.view(local, shard_len)
    else:
        staging = flat.new_empty(local, width)
        _fill_rows(staging[:, :shard_len], flat)
        if step.needs_flag:
            staging[:, shard_len] = (~torch.isfinite(flat)).any().to(flat.dtype)
    if op == "mean":
        staging[:, :shard_len].div_(local)  # divide first: fp16 node sums stay in range
    shard_ext = flat.new_empty(width)
    reduce_scatter(shard_ext, staging.view(-1), Link.intra(topology), traffic)
    shard = shard_ext[:shard_len]

    if step is EXACT:
        if op == "mean":
            shard.div_(nodes)
        result = all_reduce(shard, Link.inter(topology), traffic)
    else:
        flag = shard_ext[shard_len:] if step.needs_flag else None
        result = step(shard, Link.inter(topology), flag, topology.local_rank * shard_len, traffic)
        if op == "sum":
            result.mul_(nodes)

    if local * shard_len == numel:
        all_gather(flat, result.contiguous(), Link.intra(topology), traffic)
    else:
        gathered = flat.new_empty(local * shard_len)
        all_gather(gathered, result.contiguous(), Link.intra(topology), traffic)
        flat.copy_(gathered[:numel])


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
