"""Topology detection on real gloo processes with simulated nodes."""
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed


def _describe(rank, world):
    from ciuicflow.topology import Topology

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topology = Topology.detect()
        again = Topology.detect()
    out = {"nodes": topology.num_nodes, "node": topology.node, "local_rank": topology.local_rank,
           "local_world_size": topology.local_world_size, "hierarchical": topology.hierarchical,
           "source": topology.source, "cached": again is topology,
           "warnings": [str(w.message) for w in caught]}
    # the subgroups really are the node's ranks and the ranks sharing this local rank
    for name, group in (("intra", topology.intra_group), ("inter", topology.inter_group)):
        if group is None:
            out[name] = None
            continue
        mine = torch.tensor([rank])
        members = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, mine, group=group)
        out[name] = [int(m) for m in members]
        assert dist.get_rank(group) == (topology.local_rank if name == "intra" else topology.node)
    return out


def test_torchrun_environment_makes_two_nodes():
    results = run_distributed(_describe, 4, nodes=2, node_env="torchrun")
    assert [(r["node"], r["local_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rank, r in enumerate(results):
        assert r["nodes"] == 2 and r["local_world_size"] == 2 and r["hierarchical"]
        assert r["source"] == "torchrun environment" and r["cached"] and not r["warnings"]
        assert r["intra"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["inter"] == [rank % 2, rank % 2 + 2]


def test_override_variable_wins_over_torchrun():
    results = run_distributed(_describe, 4, nodes=2, node_env="torchrun",
                              env={"CIUICFLOW_LOCAL_WORLD_SIZE": "1"})
    for rank, r in enumerate(results):
        assert r["nodes"] == 4 and r["node"] == rank and r["local_world_size"] == 1
        assert not r["hierarchical"] and r["source"] == "CIUICFLOW_LOCAL_WORLD_SIZE=1"
        assert r["intra"] is None and r["inter"] == [0, 1, 2, 3]


def test_host_names_make_one_node_without_environment():
    results = run_distributed(_describe, 3, nodes=1, node_env="none")
    for r in results:
        assert r["nodes"] == 1 and r["source"] == "host names" and not r["hierarchical"]
        assert r["intra"] == [0, 1, 2] and r["inter"] is None


def test_uneven_nodes_warn_once_and_fall_back_to_flat():
    results = run_distributed(_describe, 4, node_sizes=[3, 1])
    for r in results:
        assert r["nodes"] == 2 and r["local_world_size"] is None and not r["hierarchical"]
        assert r["intra"] is None and r["inter"] is None
        assert len(r["warnings"]) == 1 and "uneven" in r["warnings"][0]


def _subgroup_topology(rank, world):
    """Only the members of a subgroup detect its topology; the others never call in."""
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce
    from ciuicflow.topology import Topology

    odd_even = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]
    group = odd_even[rank % 2]
    topology = Topology.detect(group)
    x = torch.full((10,), float(rank))
    hierarchical_all_reduce(x, topology)
    members = [r for r in range(world) if r % 2 == rank % 2]
    return topology.describe(), topology.hierarchical, x[0].item(), sum(members) / len(members)


def test_topology_of_a_subgroup():
    # 8 ranks, 2 nodes of 4: the even ranks form a group spanning both nodes, 2 per node
    for describe, hierarchical, got, want in run_distributed(_subgroup_topology, 8, nodes=2,
                                                              timeout=180):
        assert hierarchical and describe.startswith("2 node(s) x 2 rank(s)")
        assert got == pytest.approx(want)


def _half_then_whole_world(rank, world):
    """The first half's topology (members only), then the world's: every rank builds every
    subgroup of the world (as a device-bound NCCL default group needs), so none may be reused from
    the half's, which only its members built (node 0's group has the same ranks in both)."""
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce
    from ciuicflow.topology import Topology

    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    half = Topology.detect(halves[rank // 4])
    whole = Topology.detect()
    x = torch.full((10,), float(rank))
    hierarchical_all_reduce(x, whole)
    return (half.intra_group is not whole.intra_group, dist.get_process_group_ranks(whole.intra_group),
            x[0].item())


def test_world_subgroups_are_built_by_every_rank_after_a_subgroups_topology():
    for rank, (distinct, intra, mean) in enumerate(
            run_distributed(_half_then_whole_world, 8, nodes=4, timeout=180)):
        assert distinct and intra == [rank - rank % 2, rank - rank % 2 + 1]
        assert mean == pytest.approx(3.5)


def _bad_override(rank, world):
    from ciuicflow.topology import Topology

    with pytest.raises(ValueError, match="positive integer"):
        Topology.detect()
    return True


def test_bad_override_is_a_clear_error():
    assert run_distributed(_bad_override, 2, nodes=1, node_env="none",
                           env={"CIUICFLOW_LOCAL_WORLD_SIZE": "zero"}) == [True, True]


def test_detect_without_init_is_a_clear_error():
    from ciuicflow.topology import Topology

    if dist.is_initialized():
        pytest.skip("a process group exists in the test process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        Topology.detect()
