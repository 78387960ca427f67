"""The rank x rank traffic matrix, derived from per-link-class bytes and the node layout.

Hook states count the bytes each rank sends per link class (intra-node, inter-node), not per
peer. The matrix spreads them over the peers the collectives talk to:

- intra-node bytes of rank r go in equal shares to the other ranks of r's node;
- inter-node bytes, model ``"hierarchical"`` (the hierarchical hooks: the inter-node step runs
  between ranks of equal local rank), go in equal shares to the ranks of the other nodes that
  share r's local rank (all off-node ranks when no node has that local rank);
- inter-node bytes, model ``"flat"`` (flat hooks, plain all-reduce), go in equal shares to all
  ranks on other nodes.

Row sums therefore equal each rank's recorded bytes; the split across peers is a model (a ring
all-reduce, for one, only ever sends to its neighbour), not a measurement. Pure Python.
"""
from __future__ import annotations

TRAFFIC_MODELS = ("hierarchical", "flat")


def local_ranks(node_of_rank: list[int]) -> list[int]:
    """Each rank's position among the ranks of its node, in rank order."""
    seen: dict[int, int] = {}
    result = []
    for node in node_of_rank:
        result.append(seen.get(node, 0))
        seen[node] = seen.get(node, 0) + 1
    return result


def traffic_matrix(node_of_rank: list[int], intra_bytes: list[float], inter_bytes: list[float],
                   model: str = "hierarchical") -> list[list[float]]:
    """``matrix[r][p]``: modelled bytes rank ``r`` sent to rank ``p``."""
    if model not in TRAFFIC_MODELS:
        raise ValueError(f"traffic model must be one of {TRAFFIC_MODELS}, got {model!r}")
    world = len(node_of_rank)
    if len(intra_bytes) != world or len(inter_bytes) != world:
        raise ValueError(f"need one intra and one inter byte count per rank ({world}), got "
                         f"{len(intra_bytes)} and {len(inter_bytes)}")
    local = local_ranks(node_of_rank)
    matrix = [[0.0] * world for _ in range(world)]
    for rank in range(world):
        node = node_of_rank[rank]
        same_node = [p for p in range(world) if p != rank and node_of_rank[p] == node]
        off_node = [p for p in range(world) if node_of_rank[p] != node]
        peers = off_node
        if model == "hierarchical":
            peers = [p for p in off_node if local[p] == local[rank]] or off_node
        for targets, nbytes in ((same_node, intra_bytes[rank]), (peers, inter_bytes[rank])):
            if not nbytes:
                continue
            if not targets:
                raise ValueError(f"rank {rank} recorded {nbytes:g} bytes on a link class it has "
                                 f"no peers on (node_of_rank={node_of_rank})")
            for peer in targets:
                matrix[rank][peer] += nbytes / len(targets)
    return matrix
