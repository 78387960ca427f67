"""The outer exchange: a fragment's pseudo-gradient averaged across nodes by a registry compressor.

Inside a node the replicas are equal (DDP keeps them so), so no node sum is needed: with L ranks
per node, local rank ``i`` of every node exchanges shard ``i`` of the pseudo-gradient with its
peers of the other nodes (a flat route over one rank per node: every byte of it crosses nodes),
then the node's ranks all-gather their shards (CPU tensors through the node's shared memory,
``collectives.node_shm``, where its ranks can map it). Each inter-node link carries 1/L of the
fragment, as the hierarchical route's would, without its node sum. Under FSDP2 each rank holds its
own shards: it exchanges all of them with its peers and gathers nothing.

The compressor is the one the DDP hooks use, called the way ``ddp/state.py`` calls it:
``compressor.exchange(flat, memory, route, context, traffic)``, the route's ``add_exact`` counting
what an exact exchange would have sent; its wire plan comes from ``compression.policy``.

DiLoCo runs its exchanges on its own process groups: with ``fragment_sync_delay`` they run on a
worker thread while the training thread's DDP issues its collectives, and two threads must never
issue collectives on one gloo/NCCL group.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ciuicflow.collectives import node_shm
from ciuicflow.collectives.primitives import Hop, Traffic, add_traffic, all_gather, nonfinite_flag
from ciuicflow.collectives.routes import NODE_SUM_ENV, FlatRoute
from ciuicflow.compression.base import Context, ExactCompressor
from ciuicflow.compression.registry import FAMILIES
from ciuicflow.topology import Topology

EXACT_CODECS = ("exact", "allreduce")


def make_compressor(codec: str, options: dict | None):
    """A registry compressor by family name ("int8", "int4", "onebit"), or the exact mean."""
    options = dict(options or {})
    if codec in EXACT_CODECS:
        if options:
            raise ValueError(f"codec {codec!r} takes no options, got {sorted(options)}")
        return ExactCompressor()
    entry = FAMILIES.get(codec)
    if entry is None or entry.cost.kind not in ("exact", "quantized"):
        # PowerSGD reads matrices from a tensor's segments, which a node's shards cut apart
        choices = EXACT_CODECS + tuple(f for f, e in FAMILIES.items() if e.cost.kind == "quantized")
        raise ValueError(f"codec must be one of {choices}, got {codec!r}")
    return entry.compressor_class()(**options)


def node_members(ranks_per_node: int | None = None) -> list[tuple[int, ...]]:
    """The ranks of each node: ``Topology.detect()``'s nodes (uneven ones refused), or nodes of
    ``ranks_per_node`` consecutive ranks."""
    world = dist.get_world_size()
    if ranks_per_node is None:
        topology = Topology.detect()
        if not topology.uniform:
            sizes = sorted(len(topology.ranks_on_node(n)) for n in range(topology.num_nodes))
            raise ValueError(f"ciuicflow.diloco: nodes of uneven sizes {sizes} "
                             f"({topology.source}); pass ranks_per_node or fix the launch")
        return [tuple(topology.ranks_on_node(n)) for n in range(topology.num_nodes)]
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
            or ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(f"ciuicflow.diloco: {world} ranks do not divide into nodes of "
                         f"ranks_per_node={ranks_per_node!r}")
    return [tuple(range(n, n + ranks_per_node)) for n in range(0, world, ranks_per_node)]


class NodeLayout:
    """Which ranks form each node, and DiLoCo's own groups: the world, each node, and each set of
    ranks sharing a local rank (one per node). Every rank of the world builds every group, in the
    same order (``dist.new_group``'s contract)."""

    def __init__(self, ranks_per_node: int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ciuicflow.diloco needs torch.distributed to be initialised: call "
                               "torch.distributed.init_process_group() first")
        world, rank = dist.get_world_size(), dist.get_rank()
        members = node_members(ranks_per_node)
        self.members = [tuple(m) for m in members]
        self.nodes, self.local = len(members), len(members[0])
        self.node = next(n for n, m in enumerate(members) if rank in m)
        self.local_rank = self.members[self.node].index(rank)
        self.world_group = dist.new_group(list(range(world)))
        node_groups = [dist.new_group(list(m)) for m in self.members]
        peer_sets = [[m[i] for m in self.members] for i in range(self.local)]
        peer_groups = [dist.new_group(sorted(p)) for p in peer_sets]
        self.node_group = node_groups[self.node]
        self.peer_group = peer_groups[self.local_rank]
        self.peers = tuple(peer_sets[self.local_rank])
        # the peers seen as nodes of one rank each: a flat route whose every byte leaves the node
        self.peer_topology = Topology(self.peer_group, dist.get_rank(self.peer_group), self.nodes,
                                      tuple(range(self.nodes)), "ciuicflow.diloco peers",
                                      tuple(sorted(self.peers)))

    def describe(self) -> str:
        return f"{self.nodes} node(s) x {self.local} rank(s)"


class OuterExchange:
    """Averages fragments' pseudo-gradients across nodes; one error-feedback memory per fragment.

    ``sharded``: each rank holds distinct shards of the parameters (FSDP2): it exchanges all it
    holds; else the node's ranks split the fragment between them and gather it back."""

    def __init__(self, layout: NodeLayout, compressor, fragments: int, sharded: bool):
        self.layout, self.compressor, self.sharded = layout, compressor, sharded
        self.route = FlatRoute(layout.peer_topology)
        self.memories = [compressor.new_memory() for _ in range(fragments)]
        # per fragment, reused from one sync to the next (a fresh vector this size costs a page
        # fault per 4 KiB): its pseudo-gradient, padded to whole shards so that this rank's shard
        # is a view of it; and the node's gathered mean. A fragment's next sync is sent only after
        # its last one is applied, so neither is overwritten while still read.
        self._deltas: list[torch.Tensor | None] = [None] * fragments
        self._gathered: list[torch.Tensor | None] = [None] * fragments

    def shard_len(self, numel: int) -> int:
        return numel if self.sharded else -(-numel // self.layout.local)

    def padded_len(self, numel: int) -> int:
        return numel if self.sharded else self.shard_len(numel) * self.layout.local

    def delta_buffer(self, index: int, numel: int, device) -> torch.Tensor:
        """Where fragment ``index``'s pseudo-gradient (float32, ``numel`` elements) is written
        before ``run``: a view of a buffer this exchange keeps. ``run`` overwrites it (the mean may
        be returned in it)."""
        return _reused(self._deltas, index, self.padded_len(numel), device)[:numel]

    def agree_finite(self, delta: torch.Tensor) -> bool:
        """Whether every rank's pseudo-gradient is finite (one float over the whole world), so
        that all ranks skip, or none."""
        flag = nonfinite_flag(delta)
        dist.all_reduce(flag, group=self.layout.world_group)
        return float(flag) == 0.0

    def run(self, index: int, delta: torch.Tensor, outer_step: int):
        """(the mean of ``delta`` over the nodes, or None where some rank's is not finite; the
        bytes sent). Collective over every rank of the world."""
        traffic = Traffic()
        if not self.agree_finite(delta):
            return None, traffic
        numel, local = delta.numel(), self.layout.local
        if self.sharded or local == 1:
            piece = delta
        else:
            length = self.shard_len(numel)
            padded = _reused(self._deltas, index, local * length, delta.device)
            if delta.data_ptr() != padded.data_ptr():  # not written in place (delta_buffer)
                padded[:numel].copy_(delta)
            padded[numel:].zero_()  # the last shard's padding
            start = self.layout.local_rank * length
            piece = padded[start:start + length]
        if piece.numel() and self.layout.nodes > 1:
            self.route.add_exact(traffic, piece)
            context = Context(step=outer_step, key=index)
            result = self.compressor.exchange(piece, self.memories[index], self.route, context,
                                              traffic)
            if result is not None and result is not piece:
                piece.copy_(result)
        if piece is delta:
            return delta, traffic
        hop = Hop(self.layout.node_group, local, 0.0)
        segment = self._node_segment(piece)
        if segment is not None:
            try:  # the node's shards around this rank's, in place: the mean is the buffer
                segment.all_gather(padded, piece)
                add_traffic(traffic, hop, (local - 1) * piece.numel() * piece.element_size())
                return padded[:numel], traffic
            except node_shm.Unavailable as exc:  # it could not grow: gloo from now on
                node_shm.disable_group(self.layout.node_group, exc)
        gathered = _reused(self._gathered, index, local * piece.numel(), piece.device)
        all_gather(gathered, piece, hop, traffic)
        return gathered[:numel], traffic

    def _node_segment(self, piece: torch.Tensor):
        """The node's shared segment for the gather of CPU shards (gloo would carry them through
        the kernel's TCP stack), or None: other devices, ``CIUICFLOW_NODE_SUM`` set to a
        collective, or ranks that cannot share memory. Collective over the node the first time."""
        if piece.device.type != "cpu" or os.environ.get(NODE_SUM_ENV, "auto") in (
                "all_reduce", "reduce_scatter"):
            return None
        layout = self.layout
        return node_shm.group_segment(layout.node_group, layout.local_rank, layout.local)

    def wire_plan(self):
        """What the last exchange sent (``compression.policy.WirePlan``), where planned."""
        for memory in self.memories:
            plan = getattr(memory, "wire_plan", None)
            if plan is not None:
                return plan
        return None

    def state_dict(self) -> list:
        return [None if m is None else m.state_dict() for m in self.memories]

    def load_state_dict(self, state: list) -> None:
        if len(state) != len(self.memories):
            raise ValueError(f"checkpoint has {len(state)} fragments' memories, this DiLoCo "
                             f"{len(self.memories)}")
        for memory, saved in zip(self.memories, state):
            if (memory is None) != (saved is None):
                raise ValueError("checkpoint's error-feedback memories are for another codec")
            if memory is not None:
                memory.load_state_dict(saved)


def _reused(buffers: list, index: int, length: int, device) -> torch.Tensor:
    """``buffers[index]``: float32 [``length``] on ``device``, made (zeroed) where it is missing
    or unfit, else as the last call left it."""
    buffer = buffers[index]
    if buffer is None or buffer.numel() != length or buffer.device != torch.device(device):
        buffer = buffers[index] = torch.zeros(length, device=device)
    return buffer
