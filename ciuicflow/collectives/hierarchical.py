"""The exact all-reduces, as functions: along the hierarchical route, or flat over the group.

``hierarchical_all_reduce`` takes an optional ``inter_node`` step (``routes`` says what a step is),
so a compressor's exchange can be run on the inter-node hop of any tensor.
"""
from __future__ import annotations

import torch

from ciuicflow.collectives.primitives import Traffic, check_reducible
from ciuicflow.collectives.routes import EXACT, OPS, FlatRoute, HierarchicalRoute
from ciuicflow.topology import Topology


def hierarchical_all_reduce(tensor: torch.Tensor, topology: Topology | None = None, *,
                            op: str = "mean", inter_node=None,
                            traffic: Traffic | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the topology's group and return it.

    ``op`` is ``"mean"`` or ``"sum"``. ``inter_node`` is the inter-node step (default: exact).
    ``traffic`` (a ``Traffic``) accumulates the bytes sent, and the bytes an exact all-reduce along
    the same path sends. Every rank of the group must call this with tensors of the same size.
    """
    return _reduce(HierarchicalRoute, tensor, topology, op, inter_node or EXACT, traffic)


def flat_all_reduce(tensor: torch.Tensor, topology: Topology | None = None, *, op: str = "mean",
                    traffic: Traffic | None = None) -> torch.Tensor:
    """Exact all-reduce of ``tensor`` in place over the whole group, ignoring nodes; return it."""
    return _reduce(FlatRoute, tensor, topology, op, EXACT, traffic)


def _reduce(route_class, tensor, topology, op, step, traffic):
    check_reducible(tensor)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    route = route_class(topology if topology is not None else Topology.detect())
    flat = tensor.view(-1)
    route.add_exact(traffic, flat)
    route.reduce(flat, step, traffic, op)
    return tensor
