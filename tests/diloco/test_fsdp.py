"""ciuicflow.diloco with FSDP2 inside the node, on real gloo processes: 2 simulated nodes x 2 ranks,
a model ``fully_shard``-ed over ``mesh["shard"]`` of a (2, 2) mesh ("replicate", "shard").

DiLoCo reads and writes each rank's local shards and exchanges them with the same local rank of the
other node. Each node starts from its own random weights and each rank draws its own batches, so the
nodes drift apart between outer steps. The second Linear's 5 rows shard unevenly (3 and 2), so the
two local ranks hold different numbers of elements; cut into fragments by those, the model would
split at different parameters on the two ranks of a node.
"""
import pytest
import torch
import torch.distributed as dist

from tests.diloco.delayed import one_delayed_sync
from tests.dist_utils import run_distributed

H = 4  # sync_every
PERIODS = 3


def _setup(rank, **options):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ciuicflow.diloco as diloco

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(100 + rank // 2)  # the nodes start apart; a node's ranks alike (one model)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options.setdefault("sync_every", H)
    return model, optimizer, diloco.DiLoCo(model, **options)


def _inner_step(model, optimizer, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=gen)
    y = torch.randint(0, 5, (8,), generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()


def _full(model):
    """The whole model's parameters (each gathered over the node's shards)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _gather(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return gathered


def _all_equal(tensor):
    gathered = _gather(tensor)
    return all(torch.equal(g, gathered[0]) for g in gathered)


RUNS = {  # name: DiLoCo's options
    "exact": dict(codec="exact"),  # no inner optimizer given: the outer step is the mean (lr 1)
    "int4": dict(),  # the default codec (int4 with error feedback), the whole model at once
    "int4-streaming": dict(fragments=2, fragment_sync_delay=1),
}


def _run(rank, world, options):
    model, optimizer, diloco = _setup(rank, **options)
    params = list(model.parameters())
    # which parameters each fragment holds, by position; the full_tensor() calls below gather a
    # fragment's parameters by this rank's cut, which a node's ranks must share: compared first
    position = {id(p): i for i, p in enumerate(params)}
    cut = [[position[id(p)] for p in f.params] for f in diloco.fragments]
    # the nodes started apart; DiLoCo's broadcast gave every node node 0's weights
    report = {"start_equal": _all_equal(_full(model)), "after_apply": [], "between": [],
              "mean": [], "cut": cut}
    cuts = [None] * world
    dist.all_gather_object(cuts, cut)
    if any(c != cut for c in cuts):
        report["cuts"] = cuts
        diloco.close()
        return report
    anchor = _full(model)
    delay = diloco.schedule.delay
    for step in range(1, PERIODS * H + 1):
        _inner_step(model, optimizer, rank, step)
        before = _full(model)  # this node's parameters before the outer step, if one lands now
        diloco.step()
        applied = diloco.schedule.sends_at(step - delay) if step > delay else []
        after = _full(model)
        for k in applied:  # the fragments just stepped: the same on every node
            fragment = torch.cat([params[i].full_tensor().detach().reshape(-1)
                                  for i in cut[k]])
            report["after_apply"].append((step, k, _all_equal(fragment)))
        if not applied:
            report["between"].append(_all_equal(after))
        if applied and len(diloco.fragments) == 1 and delay == 0:
            # each node's pseudo-gradient, halved and summed (the exact route's mean over 2
            # nodes), stepped with lr 1: that arithmetic bit for bit, and the nodes' mean
            nodes = _gather(before)[::2]
            want = anchor - ((anchor - nodes[0]) / 2 + (anchor - nodes[1]) / 2)
            plain = (nodes[0] + nodes[1]) / 2
            report["mean"].append((step, torch.equal(after, want),
                                   (after - plain).abs().max().item()))
            anchor = after
    report["stats"] = diloco.stats()
    report["local_numel"] = sum(f.numel for f in diloco.fragments)
    diloco.close()
    return report


@pytest.mark.parametrize("name", list(RUNS))
def test_fsdp2_inside_the_node(name):
    options = RUNS[name]
    reports = run_distributed(_run, 4, nodes=2, args=(options,))
    fragments = options.get("fragments", 1)
    # every rank cuts the model where the whole parameters' sizes put it: Linear(6, 12)'s 84
    # elements, then the rest (Linear(12, 5)'s 65); by the local shards rank 1 (36 + 6, then
    # 24 + 2) would cut after the first weight alone
    want = [[0, 1, 2, 3]] if fragments == 1 else [[0, 1], [2, 3]]
    assert all("cuts" not in r and r["cut"] == want for r in reports), \
        [r.get("cuts", r["cut"]) for r in reports]
    # the two local ranks hold different shards: (6x12 + 12) / 2 + (3 or 2) x (12 + 1)
    assert [r["local_numel"] for r in reports] == [42 + 39, 42 + 26, 42 + 39, 42 + 26]
    for rank, report in enumerate(reports):
        assert report["start_equal"], rank
        assert len(report["after_apply"]) == PERIODS * fragments - (fragments > 1), rank
        for step, k, equal in report["after_apply"]:
            assert equal, (rank, step, k)
        assert not all(report["between"]), rank  # the nodes did drift
        if name == "exact":
            assert len(report["mean"]) == PERIODS, rank
            for step, bitwise, error in report["mean"]:
                assert bitwise and error < 1e-6, (rank, step, error)
        stats = report["stats"]
        assert stats["inner_steps"] == PERIODS * H and stats["skipped_outer_steps"] == 0
        assert stats["inter_node_bytes"] > 0 and stats["exact_outer_inter_node_bytes"] > 0
        assert stats["intra_node_bytes"] == 0  # FSDP2: each rank exchanges its own shards
        if name == "exact":
            # a 2-rank ring all-reduce sends each float32 once: 4 bytes an element, each sync
            numel = report["local_numel"]
            assert stats["inter_node_bytes"] == stats["exact_outer_inter_node_bytes"] \
                == PERIODS * 4 * numel, (rank, stats)
        else:
            assert stats["wire_plan"].startswith("int4")
            assert stats["inter_node_bytes"] < stats["exact_outer_inter_node_bytes"] / 3, stats


def _keep_progress(rank, world):
    model, optimizer, diloco = _setup(rank, codec="exact", fragment_sync_delay=1,
                                      keep_local_progress=True)
    at_send, before_apply, after = one_delayed_sync(
        diloco, lambda step: _inner_step(model, optimizer, rank, step), lambda: _full(model), H)
    # this rank's anchor (its shards): the same as the other node's rank of the same local rank
    anchor = torch.cat([a.detach() for a in diloco.anchors])
    anchors = [None] * world  # the two local ranks' shards differ in size: as objects
    dist.all_gather_object(anchors, anchor)
    report = {"moved": (before_apply - at_send).abs().max().item(),
              "kept": (after - (before_apply - at_send) - torch.stack(_gather(at_send)[::2]).mean(0))
              .abs().max().item(),
              "anchors_equal_across_nodes": torch.equal(*anchors[rank % 2::2]),
              "replicas_equal": all(torch.equal(g, after) for g in _gather(after))}
    diloco.sync()
    full = _full(model)
    report["after_sync"] = all(torch.equal(g, full) for g in _gather(full))
    diloco.close()
    return report


def test_keep_local_progress_on_local_shards():
    for report in run_distributed(_keep_progress, 4, nodes=2):
        # each shard became the nodes' mean at the send plus its own node's step after it
        assert report["moved"] > 1e-4 and report["kept"] < 1e-6, report
        assert report["anchors_equal_across_nodes"] and not report["replicas_equal"]
        assert report["after_sync"]
