"""Algorithms over torch.distributed, independent of DDP.

- ``hierarchical``: intra-node reduce-scatter -> inter-node step -> intra-node all-gather;
- ``onebit``: the two-phase 1-bit all-reduce with worker and server error feedback;
- ``powersgd``: low-rank compression with error feedback and warm start.

This module holds what they share: a ``Link`` (a process group and how much of its traffic leaves
the node), ``Traffic`` (bytes sent, counted per link), and the four primitive collectives, which
issue the torch.distributed call and count its bytes.

Bytes are counted with the usual bandwidth-optimal model, per rank: an all-reduce of B bytes over
W ranks sends 2(W-1)/W * B, a reduce-scatter or all-gather (W-1)/W * B of the full buffer, an
all-to-all (W-1)/W * B. On a group that spans nodes, the share sent to peers on other nodes is the
share of those peers among the W-1 others. These are modelled bytes, not bytes measured on a wire.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

# torch >= 2.11 renamed the tensor-in/tensor-out collectives; keep working on older releases.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Link:
    """A process group seen from this rank: its size, and the share of its traffic that leaves
    the node."""

    group: object
    size: int
    inter_share: float

    @staticmethod
    def intra(topology) -> "Link":
        return Link(topology.intra_group, topology.local_world_size, 0.0)

    @staticmethod
    def inter(topology) -> "Link":
        return Link(topology.inter_group, topology.num_nodes, 1.0)

    @staticmethod
    def flat(topology) -> "Link":
        size = topology.world_size
        others = size - 1
        off_node = size - topology.local_ranks_on_my_node
        return Link(topology.group, size, off_node / others if others else 0.0)


@dataclass
class Traffic:
    """Bytes this rank sent, split into intra-node and inter-node, next to the bytes an exact
    (uncompressed) all-reduce of the same tensors along the same path would have sent."""

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    exact_intra_bytes: float = 0.0
    exact_inter_bytes: float = 0.0
    nonfinite_fallbacks: int = 0
    guard_exact_steps: int = 0  # exact steps the accuracy guard asked for

    def add(self, link: Link, nbytes: float) -> None:
        self.inter_bytes += nbytes * link.inter_share
        self.intra_bytes += nbytes * (1.0 - link.inter_share)

    def add_exact(self, link: Link, nbytes: float) -> None:
        self.exact_inter_bytes += nbytes * link.inter_share
        self.exact_intra_bytes += nbytes * (1.0 - link.inter_share)

    def merge(self, other: "Traffic") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


GUARD_EMA = 0.9  # the gradient norm the guard divides by is a running mean over about 10 steps


def update_guard(memory, error_norm: float, grad_norm: float) -> None:
    """The accuracy guard's measure of a compressor's memory (any object with
    ``relative_error``, ``_grad_norm_ema`` and ``_guard_stale``): ||memory|| over the running mean
    of ||gradient||. The running mean, not this step's norm: near convergence, or where the
    learning rate decays to 0, gradients shrink faster than the memory drains, and dividing by the
    last one alone raised alarms on runs that kept exact accuracy."""
    ema = memory._grad_norm_ema
    ema = grad_norm if ema is None else GUARD_EMA * ema + (1 - GUARD_EMA) * grad_norm
    memory._grad_norm_ema = ema
    memory.relative_error = error_norm / ema if ema > 0 else 0.0
    memory._guard_stale = False


def snapshot(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy for a state_dict, of a buffer that later steps reuse and overwrite."""
    return None if tensor is None else tensor.detach().clone()


def ring_all_reduce_bytes(nbytes: int, size: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``nbytes`` over ``size`` ranks."""
    return 2.0 * (size - 1) / size * nbytes if size > 1 else 0.0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def add_traffic(traffic: Traffic | None, link: Link, nbytes: float) -> None:
    """Count bytes moved outside the four collectives (through shared memory)."""
    if traffic is not None:
        traffic.add(link, nbytes)


def all_reduce(tensor: torch.Tensor, link: Link, traffic: Traffic | None) -> torch.Tensor:
    """Sum ``tensor`` in place over the link's group."""
    dist.all_reduce(tensor, group=link.group)
    if traffic is not None:
        traffic.add(link, ring_all_reduce_bytes(_nbytes(tensor), link.size))
    return tensor


def reduce_scatter(output: torch.Tensor, inp: torch.Tensor, link: Link,
                   traffic: Traffic | None) -> torch.Tensor:
    """``output`` = this rank's 1/size slice of the sum of ``inp`` over the group."""
    _reduce_scatter_single(output.view(-1), inp.reshape(-1), group=link.group)
    if traffic is not None:
        traffic.add(link, (link.size - 1) / link.size * _nbytes(inp))
    return output


def all_gather(output: torch.Tensor, inp: torch.Tensor, link: Link,
               traffic: Traffic | None) -> torch.Tensor:
    """``output`` = the concatenation of every rank's ``inp``, in group-rank order."""
    _all_gather_single(output.view(-1), inp.reshape(-1), group=link.group)
    if traffic is not None:
        traffic.add(link, (link.size - 1) * _nbytes(inp))
    return output


def all_to_all(output: torch.Tensor, inp: torch.Tensor, link: Link,
               traffic: Traffic | None) -> torch.Tensor:
    """Row ``j`` of ``inp`` goes to rank ``j``; row ``i`` of ``output`` comes from rank ``i``."""
    dist.all_to_all_single(output, inp, group=link.group)
    if traffic is not None:
        traffic.add(link, (link.size - 1) / link.size * _nbytes(inp))
    return output
