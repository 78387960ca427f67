"""The leaf of the collectives: counted collectives and what every algorithm shares.

A ``Hop`` is a process group seen from this rank (its size, and the share of its traffic that
leaves the node); ``Traffic`` counts the bytes sent, per hop; the primitive collectives issue
the torch.distributed call and count its bytes; ``nonfinite_flag`` is the one-element flag the
compressors agree on before trusting a compressed step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

# torch >= 2.11 renamed the tensor-in/tensor-out collectives; keep working on older releases.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Hop:
    """A process group seen from this rank: its size, and the share of its traffic that leaves
    the node."""

    group: object
    size: int
    inter_share: float

    @staticmethod
    def intra(topology) -> "Hop":
        return Hop(topology.intra_group, topology.local_world_size, 0.0)

    @staticmethod
    def inter(topology) -> "Hop":
        return Hop(topology.inter_group, topology.num_nodes, 1.0)

    @staticmethod
    def flat(topology) -> "Hop":
        size = topology.world_size
        others = size - 1
        off_node = size - topology.local_ranks_on_my_node
        return Hop(topology.group, size, off_node / others if others else 0.0)


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
    adaptive_codec_reductions: int = 0  # tensors sent with the codec for adaptive optimizers
    # tensors whose workers or servers sent more than the method's own codec (a 1-bit method's
    # steps that were not all 1 bit)
    beyond_target_reductions: int = 0

    def add(self, hop: Hop, nbytes: float) -> None:
        self.inter_bytes += nbytes * hop.inter_share
        self.intra_bytes += nbytes * (1.0 - hop.inter_share)

    def add_exact(self, hop: Hop, nbytes: float) -> None:
        self.exact_inter_bytes += nbytes * hop.inter_share
        self.exact_intra_bytes += nbytes * (1.0 - hop.inter_share)

    def merge(self, other: "Traffic") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def snapshot(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy for a state_dict, of a buffer that later steps reuse and overwrite."""
    return None if tensor is None else tensor.detach().clone()


def ring_all_reduce_bytes(nbytes: int, size: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``nbytes`` over ``size`` ranks."""
    return 2.0 * (size - 1) / size * nbytes if size > 1 else 0.0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def check_reducible(tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {tensor.dtype}")
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous (it is reduced in place)")


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A one-element float32 tensor, 1 when ``tensor`` holds inf or NaN, else 0.

    One float32 sum: it is non-finite exactly when an element is, or when finite values add up
    past float32's range (a false alarm that only makes a step exact). Far cheaper than
    ``isfinite(t).any()``, which materialises a mask of the whole tensor.
    """
    total = tensor.sum(dtype=torch.float32)  # 0 for an empty tensor
    return (~torch.isfinite(total)).to(torch.float32).view(1)


def add_traffic(traffic: Traffic | None, hop: Hop, nbytes: float) -> None:
    """Count bytes moved outside the four collectives (through shared memory)."""
    if traffic is not None:
        traffic.add(hop, nbytes)


def all_reduce(tensor: torch.Tensor, hop: Hop, traffic: Traffic | None) -> torch.Tensor:
    """Sum ``tensor`` in place over the hop's group."""
    dist.all_reduce(tensor, group=hop.group)
    if traffic is not None:
        traffic.add(hop, ring_all_reduce_bytes(_nbytes(tensor), hop.size))
    return tensor


def reduce_scatter(output: torch.Tensor, inp: torch.Tensor, hop: Hop,
                   traffic: Traffic | None) -> torch.Tensor:
    """``output`` = this rank's 1/size slice of the sum of ``inp`` over the group."""
    _reduce_scatter_single(output.view(-1), inp.reshape(-1), group=hop.group)
    if traffic is not None:
        traffic.add(hop, (hop.size - 1) / hop.size * _nbytes(inp))
    return output


def all_gather(output: torch.Tensor, inp: torch.Tensor, hop: Hop,
               traffic: Traffic | None) -> torch.Tensor:
    """``output`` = the concatenation of every rank's ``inp``, in group-rank order."""
    _all_gather_single(output.view(-1), inp.reshape(-1), group=hop.group)
    if traffic is not None:
        traffic.add(hop, (hop.size - 1) * _nbytes(inp))
    return output


def all_to_all(output: torch.Tensor, inp: torch.Tensor, hop: Hop,
               traffic: Traffic | None) -> torch.Tensor:
    """Row ``j`` of ``inp`` goes to rank ``j``; row ``i`` of ``output`` comes from rank ``i``."""
    dist.all_to_all_single(output, inp, group=hop.group)
    if traffic is not None:
        traffic.add(hop, (hop.size - 1) / hop.size * _nbytes(inp))
    return output


def all_to_all_uneven(output: torch.Tensor, inp: torch.Tensor, output_splits: list,
                      input_splits: list, hop: Hop, traffic: Traffic | None) -> torch.Tensor:
    """``all_to_all`` with sizes per rank: ``input_splits[j]`` elements of ``inp`` go to rank j,
    ``output_splits[i]`` of ``output`` come from rank i (each rank must know what it receives)."""
    dist.all_to_all_single(output, inp, output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=hop.group)
    if traffic is not None:
        me = dist.get_rank(hop.group)
        traffic.add(hop, (sum(input_splits) - input_splits[me]) * inp.element_size())
    return output
