"""The monitor's collective setup: where each rank sits (group, nodes, hosts, run id), and the
heartbeats and watchdog of hang detection. Both are collectives: every rank calls them, in the
same order as its other collectives."""
from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass

from ciuicflow.monitor.stragglers import HangWatchdog, Heartbeat


@dataclass
class Layout:
    """This rank's place in the group the monitor watches."""

    host: str
    rank: int
    world_size: int
    group: object | None  # the monitor's own gloo group (None when alone)
    node_of_rank: list
    hosts: list
    run_id: str
    hierarchical: bool  # whether the topology has several nodes of several ranks


def detect_layout(group, topology, states) -> Layout:
    """The layout of ``group`` (default: the topology's, else the world); without a topology, a
    state's, else one detected. Outside torch.distributed, a group of one."""
    import torch.distributed as dist

    host = socket.gethostname()
    if topology is None:
        topology = next((s.topology for s in states
                         if getattr(s, "topology", None) is not None), None)
    if not (dist.is_available() and dist.is_initialized()):
        return Layout(host, 0, 1, None, [0], [host], uuid.uuid4().hex, False)
    if group is None:
        group = topology.group if topology is not None else dist.group.WORLD
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if topology is None and world_size > 1:
        from ciuicflow.topology import Topology

        topology = Topology.detect(group)
    if topology is not None and topology.world_size != world_size:
        raise ValueError(f"topology has {topology.world_size} ranks, the group {world_size}")
    own_group = None
    infos = [{"host": host, "run_id": None}]
    if world_size > 1:
        # the monitor's collectives run on a gloo group of their own: CPU objects, and no
        # interleaving with the hooks' collectives on the training group
        # (the whole world: every rank creates it, as a device-bound NCCL default group needs)
        ranks = dist.get_process_group_ranks(group)
        own_group = dist.new_group(ranks, backend="gloo",
                                   use_local_synchronization=len(ranks) < dist.get_world_size())
        infos = [None] * world_size
        mine = {"host": host, "run_id": uuid.uuid4().hex if rank == 0 else None}
        dist.all_gather_object(infos, mine, group=own_group)
    node_of_rank = list(topology.node_of_rank) if topology is not None else [0] * world_size
    return Layout(host, rank, world_size, own_group, node_of_rank, [info["host"] for info in infos],
                  infos[0]["run_id"] or uuid.uuid4().hex,
                  bool(topology is not None and topology.hierarchical))


def hang_detection(layout: Layout, store, timeout_s: float, heartbeat_s, watchdog_rank: int,
                   on_alert) -> tuple:
    """(this rank's ``Heartbeat``, the ``HangWatchdog`` on ``watchdog_rank``, else None), not yet
    started. ``store``: shared by the ranks (default: the rendezvous store)."""
    import torch.distributed as dist

    interval = float(heartbeat_s) if heartbeat_s else min(5.0, timeout_s / 10)
    if interval <= 0:
        raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    while store is None and isinstance(base, dist.PrefixStore):
        base = base.underlying_store  # clones of a PrefixStore lose their prefix

    def own_connection():
        # each thread gets its own connection when the store can make one
        try:
            connection = base.clone()
        except (RuntimeError, NotImplementedError, AttributeError):
            connection = base
        return dist.PrefixStore(f"ciuicflow/monitor/{layout.run_id}/", connection)

    heartbeat = Heartbeat(own_connection(), layout.rank, interval)
    dist.barrier(group=layout.group)  # every heartbeat key exists before anyone reads
    watchdog = None
    if layout.rank == watchdog_rank:
        info = [{"node": n, "host": h} for n, h in zip(layout.node_of_rank, layout.hosts)]
        watchdog = HangWatchdog(own_connection(), layout.world_size, timeout_s, interval, info,
                                on_alert)
    return heartbeat, watchdog
