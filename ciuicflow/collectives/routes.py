"""Routes: the path a reduction takes, with one place on it where a compressor may run.

- ``FlatRoute``: the whole group is one hop; a compressor's exchange spans every rank.
- ``HierarchicalRoute``: intra-node node sum -> an exchange over the inter-node group -> intra-node
  all-gather. After the node sum, local rank ``i`` of every node holds shard ``i`` of its node's
  sum; the ranks sharing local rank ``i`` (one per node) run the exchange on it, and the gather
  spreads the result back inside each node. Inter-node links carry 1/L of what a flat all-reduce
  puts on them (L ranks per node).

A route offers compressors two services, which is all they need to know of the topology:

- ``reduce(flat, step, traffic, keep=None) -> result``: average ``flat`` in place, running ``step``
  on the hop the route compresses, and return it; with ``keep`` (a DDP bucket's key), the result
  may instead be a tensor the route keeps under that key (the node's shared output, valid until
  the next call with that key; ``flat``'s contents are then unspecified): the caller uses what is
  returned. A step is called as ``step(x, hop, flag, offset, traffic) -> mean of x over the hop``;
  ``offset`` is where ``x`` starts in ``flat``; ``flag`` (for steps with ``needs_flag``) is a
  one-element tensor, nonzero when the node's sum holds a non-finite value anywhere, the same on
  every rank of the node, so compressed steps can agree on an exact fallback (None on a flat
  route: the step checks its own input).
- ``sum(values, traffic)``: an exact sum over every rank along the route, for compressors that
  compress before anything is summed (PowerSGD's factors).

The node sum depends on the backend. NCCL (CUDA tensors): a reduce-scatter. Gloo (CPU tensors):
shared memory where the node's ranks can map one segment (``node_shm``), otherwise an all-reduce
of the whole tensor, each local rank taking its shard of the sum: gloo's reduce-scatter costs
more than its all-reduce of the same tensor (docs/architecture.md gives the measurement), so
intra-node links then carry twice the bytes and inter-node links the same.

Buffers of any length work: shards are padded to equal length and trimmed on the way back. When
the topology has one rank per node, or uneven nodes, a hierarchical route runs its step once over
the whole group (flat); on a single node it is exact, as nothing crosses a node boundary.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ciuicflow.collectives import node_shm
from ciuicflow.collectives.primitives import Hop, Traffic, add_traffic, all_gather, all_reduce, \
    nonfinite_flag, reduce_scatter, ring_all_reduce_bytes

OPS = ("mean", "sum")
NODE_SUM_ENV = "CIUICFLOW_NODE_SUM"
_NODE_SUMS = ("shared_memory", "all_reduce", "reduce_scatter")


class ExactStep:
    """The plain step: an exact mean over the hop."""

    needs_flag = False

    def __call__(self, x, hop, flag, offset, traffic):
        x.div_(hop.size)
        return all_reduce(x, hop, traffic)


EXACT = ExactStep()


class FlatRoute:
    """Every rank of the group in one hop."""

    name = "flat"

    def __init__(self, topology):
        self.topology = topology

    @property
    def exchange_ranks(self) -> int:
        """Ranks that take part in a compressor's exchange."""
        return self.topology.world_size

    @property
    def crosses_nodes(self) -> bool:
        return self.topology.num_nodes > 1

    def add_exact(self, traffic: Traffic | None, flat: torch.Tensor) -> None:
        """Count what an exact all-reduce of ``flat`` along this route sends."""
        topology = self.topology
        if traffic is not None and topology.world_size > 1:
            traffic.add_exact(Hop.flat(topology), ring_all_reduce_bytes(
                flat.numel() * flat.element_size(), topology.world_size))

    def sum(self, values: torch.Tensor, traffic: Traffic | None) -> torch.Tensor:
        return all_reduce(values, Hop.flat(self.topology), traffic)

    def reduce(self, flat: torch.Tensor, step, traffic: Traffic | None, op: str = "mean",
               keep=None) -> torch.Tensor:
        world = self.topology.world_size
        if world == 1 or flat.numel() == 0:
            return flat
        if step is EXACT:
            if op == "mean":
                flat.div_(world)
            all_reduce(flat, Hop.flat(self.topology), traffic)
            return flat
        result = step(flat, Hop.flat(self.topology), None, 0, traffic)
        if result is not flat:
            flat.copy_(result)
        if op == "sum":
            flat.mul_(world)
        return flat


class HierarchicalRoute(FlatRoute):
    """Node sum, a step over the nodes, node gather (flat where nodes are uneven or alone)."""

    name = "hierarchical"

    @property
    def exchange_ranks(self) -> int:
        topology = self.topology
        return topology.num_nodes if topology.hierarchical else topology.world_size

    def add_exact(self, traffic: Traffic | None, flat: torch.Tensor) -> None:
        topology = self.topology
        numel, itemsize = flat.numel(), flat.element_size()
        if traffic is None or topology.world_size == 1 or numel == 0:
            return
        if not topology.hierarchical:
            super().add_exact(traffic, flat)
            return
        local = topology.local_world_size  # with the padding to a multiple of L that reduce uses
        shard_bytes = -(-numel // local) * itemsize
        node_sum = ring_all_reduce_bytes(numel * itemsize, local) \
            if node_sum_method(flat, topology) == "all_reduce" else (local - 1) * shard_bytes
        traffic.add_exact(Hop.intra(topology), node_sum + (local - 1) * shard_bytes)
        traffic.add_exact(Hop.inter(topology),
                          ring_all_reduce_bytes(shard_bytes, topology.num_nodes))

    def sum(self, values: torch.Tensor, traffic: Traffic | None) -> torch.Tensor:
        return self.reduce(values, EXACT, traffic, op="sum")

    def reduce(self, flat: torch.Tensor, step, traffic: Traffic | None, op: str = "mean",
               keep=None) -> torch.Tensor:
        topology = self.topology
        numel, world = flat.numel(), topology.world_size
        if world == 1 or numel == 0:
            return flat
        if topology.num_nodes == 1 or (step is EXACT and not topology.hierarchical):
            if op == "mean":
                flat.div_(world)
            all_reduce(flat, Hop.flat(topology), traffic)
            return flat
        if not topology.hierarchical:  # one rank per node, or uneven nodes: the step spans all
            return super().reduce(flat, step, traffic, op)

        local, nodes = topology.local_world_size, topology.num_nodes
        shard_len = -(-numel // local)
        divide_first = op == "mean" and flat.element_size() < 4  # fp16/bf16 node sums stay in range
        if divide_first:
            flat.div_(local)
        shard_bytes = shard_len * flat.element_size()
        segment, shard, flag = _node_sum(flat, topology, shard_len, step.needs_flag, traffic, keep,
                                         local if op == "mean" and not divide_first else 1)

        if step is EXACT:
            if op == "mean":
                shard.div_(nodes)
            result = all_reduce(shard, Hop.inter(topology), traffic)
        else:
            result = step(shard, Hop.inter(topology), flag, topology.local_rank * shard_len,
                          traffic)
            if op == "sum":
                result.mul_(nodes)

        if segment is not None:
            if result is not shard:
                shard.copy_(result)
            add_traffic(traffic, Hop.intra(topology), (local - 1) * shard_bytes)
            return segment.gather(flat, shard_len)
        # The result may be a view of flat (CPU path), which the all-gather overwrites: send a copy.
        if local * shard_len == numel:
            all_gather(flat, result.clone(), Hop.intra(topology), traffic)
        else:
            gathered = flat.new_empty(local * shard_len)
            all_gather(gathered, _padded_shard(result, shard_len), Hop.intra(topology), traffic)
            flat.copy_(gathered[:numel])
        return flat


ROUTES = {route.name: route for route in (FlatRoute, HierarchicalRoute)}


# ------------------------------------------------------------------------------------------------
# The node sum


def node_sum_method(tensor: torch.Tensor, topology) -> str:
    """How the node sum of ``tensor`` is taken: "reduce_scatter" (CUDA tensors, by default),
    "shared_memory" (CPU tensors, where the node's ranks can share memory) or "all_reduce" (CPU
    tensors otherwise). ``CIUICFLOW_NODE_SUM`` forces one of the three."""
    choice = os.environ.get(NODE_SUM_ENV, "auto")
    if choice not in _NODE_SUMS + ("auto",):
        raise ValueError(f"{NODE_SUM_ENV} must be auto or one of {_NODE_SUMS}, got {choice!r}")
    if choice == "auto":
        choice = "shared_memory" if tensor.device.type == "cpu" else "reduce_scatter"
        if choice == "reduce_scatter" and dist.get_backend(topology.intra_group) == "gloo":
            choice = "all_reduce"  # CUDA tensors on gloo (one GPU shared by several processes)
    if choice == "shared_memory" and (tensor.device.type != "cpu"
                                      or node_shm.node_segment(topology) is None):
        choice = "all_reduce"
    return choice


def _node_sum(flat, topology, shard_len, needs_flag, traffic, keep=None, divisor=1):
    """(the shared segment or None, this rank's shard of the node's sum divided by ``divisor``,
    the node's flag)."""
    local = topology.local_world_size
    method = node_sum_method(flat, topology)
    if method == "shared_memory":
        segment = node_shm.node_segment(topology)
        try:
            shard, flag = segment.node_sum(flat, shard_len, needs_flag, keep, divisor)
            # what the ranks read of each other's slots: a reduce-scatter's worth
            add_traffic(traffic, Hop.intra(topology), (local - 1) * shard_len * flat.element_size())
            return segment, shard, flag
        except node_shm.Unavailable as exc:  # it could not grow: gloo from now on
            node_shm.disable(topology, exc)
            method = "all_reduce"
    if method == "all_reduce":
        shard, flag = _node_sum_by_all_reduce(flat, topology, shard_len, needs_flag, traffic)
    else:
        shard, flag = _node_sum_by_reduce_scatter(flat, topology, shard_len, needs_flag, traffic)
    if divisor != 1:
        shard.div_(divisor)
    return None, shard, flag


def _node_sum_by_all_reduce(flat, topology, shard_len, needs_flag, traffic):
    """Gloo (CPU tensors): the whole sum on every local rank; this rank's shard is a view of it,
    and the node's non-finite flag comes from the whole sum with no extra collective."""
    all_reduce(flat, Hop.intra(topology), traffic)
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
    reduce_scatter(shard, staging.view(-1), Hop.intra(topology), traffic)
    if not needs_flag:
        return shard, None
    flag = nonfinite_flag(shard)
    dist.all_reduce(flag, group=topology.intra_group)  # 4 bytes: not counted as traffic
    return shard, flag


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
