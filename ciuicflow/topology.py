"""Who is on which node, and the intra-node and inter-node process groups that follow from it.

``Topology.detect(group)`` is collective: every rank of ``group`` calls it, in the same order as its
other collectives. It finds each rank's node from, in order of precedence:

1. ``CIUICFLOW_LOCAL_WORLD_SIZE=L`` (every rank): ranks ``[0, L)`` of the group form node 0, and
   so on;
2. torchrun's ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``LOCAL_RANK`` (every rank): one node per
   ``GROUP_RANK``, so two ``torchrun --nnodes 2 --node_rank K`` on one host form two nodes;
3. otherwise the host name, gathered over the group.

A rank's local rank is its position among the ranks of its node, in global-rank order (torchrun's
``LOCAL_RANK`` for a torchrun launch); it is also its rank in the intra-node group. Nodes of
different sizes cannot be split evenly: ``detect`` warns once and the topology falls back to flat
collectives.
"""
from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

LOCAL_WORLD_SIZE_ENV = "CIUICFLOW_LOCAL_WORLD_SIZE"
_TORCHRUN_ENV = ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")

# parent group -> its Topology; subgroup rank tuple -> its process group (never built twice).
# Both belong to one default process group: a new init_process_group starts them afresh.
_TOPOLOGIES: dict[int, tuple[object, "Topology"]] = {}
# Keys of the subgroups every rank of the world built start with _WORLD_BUILT: a group that only
# its members built (for a smaller parent) is never reused where every rank must take part.
_SUBGROUPS: dict[tuple, object] = {}
_WORLD_BUILT = ("world",)
_CACHE_WORLD: list = [None]
_WARNED: set[str] = set()


def _current_caches():
    world = dist.distributed_c10d._get_default_group()
    if _CACHE_WORLD[0] is not world:
        _TOPOLOGIES.clear()
        _SUBGROUPS.clear()
        _CACHE_WORLD[0] = world


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass(frozen=True, eq=False)
class Topology:
    """The node layout of a process group and the subgroups that the hierarchical collectives use.

    ``intra_group`` holds the ranks of this rank's node; ``inter_group`` holds the ranks, one per
    node, that share this rank's local rank. Either is ``None`` when there is nothing to do on that
    level (one rank per node, a single node) or when the nodes are uneven.
    """

    group: object = field(repr=False)
    rank: int
    world_size: int
    node_of_rank: tuple[int, ...]
    source: str
    global_ranks: tuple[int, ...] = ()
    intra_group: object = field(default=None, repr=False)
    inter_group: object = field(default=None, repr=False)

    # -- detection ---------------------------------------------------------------------------

    @classmethod
    def detect(cls, group=None) -> "Topology":
        """Find the topology of ``group`` (default: the world), building its subgroups once.

        Collective over ``group`` the first time; cached afterwards."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Topology.detect needs torch.distributed to be initialised: call "
                "torch.distributed.init_process_group() first")
        _current_caches()
        group = group if group is not None else dist.group.WORLD
        cached = _TOPOLOGIES.get(id(group))
        if cached is not None and cached[0] is group:
            return cached[1]
        topology = cls._build(group)
        _TOPOLOGIES[id(group)] = (group, topology)
        return topology

    @classmethod
    def _build(cls, group) -> "Topology":
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        global_ranks = tuple(dist.get_process_group_ranks(group))
        if world_size == 1:
            return cls(group, rank, 1, (0,), "single process", global_ranks)
        descriptions = [None] * world_size
        dist.all_gather_object(descriptions, _describe_this_rank(), group=group)
        node_of_rank, source = _assign_nodes(descriptions)
        draft = cls(group, rank, world_size, node_of_rank, source, global_ranks)
        if not draft.uniform:
            sizes = sorted({len(draft.ranks_on_node(n)) for n in range(draft.num_nodes)})
            _warn_once(
                f"ciuicflow: nodes of uneven sizes {sizes} ({source}); hierarchical collectives "
                "fall back to flat ones over the whole group")
            return draft
        return draft._with_subgroups()

    # -- layout ------------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    @cached_property
    def _members(self) -> tuple[tuple[int, ...], ...]:
        """Group ranks of each node, in local-rank (global-rank) order. Computed once: the hooks
        ask for the layout several times per bucket and step, and it never changes."""
        return tuple(
            tuple(sorted((r for r, n in enumerate(self.node_of_rank) if n == node),
                         key=lambda r: self.global_ranks[r]))
            for node in range(self.num_nodes))

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        """Group ranks on ``node``, in local-rank (global-rank) order."""
        return self._members[node] if 0 <= node < len(self._members) else ()

    @property
    def local_rank(self) -> int:
        return self.ranks_on_node(self.node).index(self.rank)

    @cached_property
    def uniform(self) -> bool:
        """Every node holds the same number of ranks."""
        return len({len(members) for members in self._members}) == 1

    @property
    def local_world_size(self) -> int | None:
        """Ranks per node, or ``None`` when nodes are uneven."""
        return len(self.ranks_on_node(0)) if self.uniform else None

    @property
    def hierarchical(self) -> bool:
        """Whether the two-level (intra-node, then inter-node) collectives apply."""
        return self.uniform and self.num_nodes > 1 and self.local_world_size > 1

    @property
    def local_ranks_on_my_node(self) -> int:
        """How many ranks of the group share this rank's node (uneven nodes included)."""
        return len(self.ranks_on_node(self.node))

    def describe(self) -> str:
        if self.world_size == 1:
            return "1 rank"
        if self.uniform:
            layout = f"{self.num_nodes} node(s) x {self.local_world_size} rank(s)"
        else:
            layout = "uneven nodes " + "+".join(
                str(len(self.ranks_on_node(n))) for n in range(self.num_nodes))
        return f"{layout} ({self.source})"

    # -- subgroups ---------------------------------------------------------------------------

    def _with_subgroups(self) -> "Topology":
        if self._whole_world:
            self._make_all_subgroups()
        elif _device_bound_default_group():
            raise ValueError(
                "ciuicflow: the hierarchical collectives of a process group smaller than the world "
                "need subgroups that only its members create, which a default process group bound "
                "to a device (init_process_group(device_id=...)) cannot split without every rank: "
                "detect the topology of the whole world, or initialise without device_id")
        return Topology(self.group, self.rank, self.world_size, self.node_of_rank, self.source,
                        self.global_ranks, self._make_intra_group(), self._make_inter_group())

    @property
    def _whole_world(self) -> bool:
        return len(self.global_ranks) == dist.get_world_size()

    def _global_ranks(self, group_ranks) -> list[int]:
        return [self.global_ranks[r] for r in group_ranks]

    def _subgroup_rank_sets(self) -> list[list[int]]:
        """Every intra-node group, then every inter-node group, as global ranks (a fixed order)."""
        if self.local_world_size == 1 or self.num_nodes == 1:
            return []  # the group itself, or nothing, serves each level
        intra = [self.ranks_on_node(n) for n in range(self.num_nodes)]
        inter = [[ranks[local] for ranks in intra] for local in range(self.local_world_size)]
        return [self._global_ranks(ranks) for ranks in intra + inter]

    def _make_all_subgroups(self) -> None:
        """Over the whole world, every rank creates every subgroup, in the same order: the way
        ``new_group`` works with every backend, NCCL's communicator splits of a device-bound
        default group included (non-members take part in the split)."""
        for ranks in self._subgroup_rank_sets():
            key = _WORLD_BUILT + tuple(sorted(ranks))
            if key not in _SUBGROUPS:
                _SUBGROUPS[key] = dist.new_group(list(key[1:]))

    def _make_intra_group(self):
        if self.local_world_size == 1:
            return None
        if self.num_nodes == 1:
            return self.group
        return _subgroup(self._global_ranks(self.ranks_on_node(self.node)), self._whole_world)

    def _make_inter_group(self):
        if self.num_nodes == 1:
            return None
        if self.local_world_size == 1:
            return self.group
        peers = [self.ranks_on_node(n)[self.local_rank] for n in range(self.num_nodes)]
        return _subgroup(self._global_ranks(peers), self._whole_world)


def _device_bound_default_group() -> bool:
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None) is not None


def _subgroup(global_ranks: list[int], whole_world: bool):
    """A process group over ``global_ranks``, built once per rank set.

    Subgroups of the whole world were all built by ``_make_all_subgroups``. For a smaller parent
    group only its members call this (local synchronisation), so the ranks outside it need not
    take part. Every rank builds its intra-node group before its inter-node group, so no two ranks
    wait on each other's creations in opposite orders."""
    key = (_WORLD_BUILT if whole_world else ()) + tuple(sorted(global_ranks))
    group = _SUBGROUPS.get(key)
    if group is None:
        group = dist.new_group(list(key), use_local_synchronization=True)
        _SUBGROUPS[key] = group
    # Group ranks follow global-rank order, as local ranks do: the shard a rank holds after the
    # intra-node reduce-scatter is the one its inter-node peers hold.
    return group


def _describe_this_rank() -> dict:
    description = {"host": socket.gethostname()}
    override = os.environ.get(LOCAL_WORLD_SIZE_ENV)
    if override is not None:
        description["override"] = override
    if all(name in os.environ for name in _TORCHRUN_ENV):
        description["torchrun"] = tuple(os.environ[name] for name in _TORCHRUN_ENV)
    return description


def _assign_nodes(descriptions: list[dict]) -> tuple[tuple[int, ...], str]:
    """Node index of every rank (nodes numbered by their lowest rank), and where it came from."""
    if "node" in descriptions[0]:
        keys, source = [d["node"] for d in descriptions], "explicit"
    elif any("override" in d for d in descriptions):
        values = {d.get("override") for d in descriptions}
        if len(values) != 1:
            raise ValueError(f"{LOCAL_WORLD_SIZE_ENV} differs across ranks: "
                             f"{sorted(map(str, values))}")
        local_world_size = _positive_int(values.pop(), LOCAL_WORLD_SIZE_ENV)
        keys = [r // local_world_size for r in range(len(descriptions))]
        source = f"{LOCAL_WORLD_SIZE_ENV}={local_world_size}"
    elif all("torchrun" in d for d in descriptions):
        keys = [d["torchrun"][1] for d in descriptions]  # GROUP_RANK: one per torchrun agent
        source = "torchrun environment"
    else:
        keys, source = [d["host"] for d in descriptions], "host names"
    numbering: dict = {}
    node_of_rank = tuple(numbering.setdefault(key, len(numbering)) for key in keys)
    return node_of_rank, source


def _positive_int(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return value
