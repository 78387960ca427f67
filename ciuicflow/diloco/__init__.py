"""Local SGD across nodes (DiLoCo, Streaming DiLoCo): inner steps as today inside a node, outer
steps across nodes every ``sync_every`` steps through the same compressors as the hooks.

    node = ciuicflow.diloco.node_group()                  # this rank's node, for DDP
    ddp = DDP(model, process_group=node)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    with ciuicflow.DiLoCo(ddp, optimizer, sync_every=64, fragments=4, fragment_sync_delay=2):
        for x, y in batches:
            loss_fn(ddp(x), y).backward()
            optimizer.step()                             # DiLoCo's step runs after it
            optimizer.zero_grad()

docs/diloco.md: the options, when to prefer it to a compressed hook, what it costs.
"""
from __future__ import annotations

from ciuicflow.diloco.diloco import DEFAULT_CODEC, DEFAULT_FRAGMENT_SYNC_DELAY, DEFAULT_FRAGMENTS, \
    DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_SGD_OUTER_LR, DEFAULT_SYNC_EVERY, DiLoCo, \
    default_outer_optimizer, nesterov, resolve_inner_lr_scale
from ciuicflow.diloco.exchange import NodeLayout, node_members

__all__ = ["DEFAULT_CODEC", "DEFAULT_FRAGMENTS", "DEFAULT_FRAGMENT_SYNC_DELAY", "DEFAULT_OUTER_LR",
           "DEFAULT_OUTER_MOMENTUM", "DEFAULT_SGD_OUTER_LR", "DEFAULT_SYNC_EVERY", "DiLoCo",
           "NodeLayout", "default_outer_optimizer", "nesterov", "node_group", "resolve_inner_lr_scale"]


def node_group(ranks_per_node: int | None = None):
    """A process group of this rank's node (``Topology.detect()``'s nodes, or ``ranks_per_node``
    consecutive ranks), for the model's DDP inside the node. Collective over the world: every rank
    builds every node's group. DiLoCo's own groups are other ones, so its exchanges may run beside
    DDP's collectives."""
    import torch.distributed as dist

    rank, mine = dist.get_rank(), None
    for members in node_members(ranks_per_node):
        group = dist.new_group(list(members))
        if rank in members:
            mine = group
    return mine
