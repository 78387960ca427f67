"""DiLoCo resumed from a ``torch.distributed.checkpoint`` (DCP) checkpoint, on real gloo processes:
2 simulated nodes x 2 ranks, DDP or FSDP2 inside each node.

A run of ``TOTAL`` inner steps straight through, saving with ``dcp.save`` after step ``SAVE_AT``,
against new processes that build everything afresh, ``dcp.load`` that checkpoint and run the steps
left: the parameters must come out bit for bit the same, and each rank must have sent the same
bytes. The checkpoint holds state of every kind DiLoCo keeps: an int4 compressor's error-feedback
memories (each rank's own), Nesterov momentum in the outer optimizers, and a fragment's sync in
flight (fragment 0 is sent after step 6 and applied after step 7). The model and the inner
optimizer are saved under ``DiLoCo.node_key``: the nodes' differ between outer steps. Saved under
one key for both nodes instead, DCP keeps one copy and the resumed run goes elsewhere (checked too,
so that the per-node key is seen to matter).
"""
import pytest
import torch

from tests.dist_utils import run_distributed

H = 4  # sync_every
SAVE_AT, TOTAL = 6, 14


def _build(rank, kind):
    """(model, the module the inner step calls, inner optimizer, DiLoCo). Each node starts from its
    own weights (DiLoCo makes them equal); the node's ranks alike."""
    import ciuicflow.diloco as diloco

    torch.manual_seed(100 + rank // 2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 5))
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model, process_group=diloco.node_group())
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        run = fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.SGD(run.parameters(), lr=0.1, momentum=0.9)
    outer = diloco.DiLoCo(run, sync_every=H, codec="int4", fragments=2, fragment_sync_delay=1,
                          outer_optimizer=diloco.nesterov(0.7, 0.9))
    return model, run, optimizer, outer


def _inner_step(run, optimizer, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=gen)
    y = torch.randint(0, 5, (8,), generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(run(x), y).backward()
    optimizer.step()


def _local(model):
    """This rank's parameters: the whole model under DDP, its shards under FSDP2."""
    return torch.cat([getattr(p, "to_local", lambda: p)().detach().reshape(-1)
                      for p in model.parameters()])


def _checkpoint(run, optimizer, outer, per_node):
    """What is saved and what a fresh run loads into. The model and the inner optimizer go under
    ``outer.node_key`` (``per_node``), or under one key for all nodes, as without DiLoCo: then DCP
    keeps one copy of what every node holds under the same name, though the nodes' differ."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(run, optimizer)
    inner = {"model": msd, "optim": osd}
    return {**({outer.node_key: inner} if per_node else inner), "diloco": outer.state_dict()}


def _train(rank, world, kind, directory, phase):
    """Straight through, saving after ``SAVE_AT`` (under ``directory``/node and /global), or
    resumed from ``directory``/``phase``."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, run, optimizer, outer = _build(rank, kind)
    start, held = 0, None
    if phase != "straight":
        state = _checkpoint(run, optimizer, outer, phase == "node")
        dcp.load(state, checkpoint_id=os.path.join(directory, phase))
        inner = state[outer.node_key] if phase == "node" else state
        set_state_dict(run, optimizer, model_state_dict=inner["model"],
                       optim_state_dict=inner["optim"])
        outer.load_state_dict(state["diloco"])
        start, held = SAVE_AT, all(o.state for o in outer.outer)
    in_flight = None
    for step in range(start + 1, TOTAL + 1):
        _inner_step(run, optimizer, rank, step)
        outer.step()
        if phase == "straight" and step == SAVE_AT:
            in_flight, held = sorted(outer._pending), all(o.state for o in outer.outer)
            for name in ("node", "global"):
                dcp.save(_checkpoint(run, optimizer, outer, name == "node"),
                         checkpoint_id=os.path.join(directory, name))
    outer.close()
    return {"params": _local(model), "bytes": outer.stats()["inter_node_bytes"],
            "in_flight": in_flight, "outer_state": held}


def _resumed(rank, world, kind, directory):
    return {phase: _train(rank, world, kind, directory, phase) for phase in ("node", "global")}


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_resume_from_dcp_checkpoint_is_bitwise_exact(tmp_path, kind):
    directory = str(tmp_path)
    straight = run_distributed(_train, 4, nodes=2, args=(kind, directory, "straight"))
    resumed = run_distributed(_resumed, 4, nodes=2, args=(kind, directory))
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert a["in_flight"] == [0], a["in_flight"]  # the save caught fragment 0 in flight
        node = b["node"]
        # every outer optimizer had momentum at the save, and had it again once loaded
        assert a["outer_state"] and node["outer_state"]
        assert torch.equal(a["params"], node["params"]), \
            (kind, rank, (a["params"] - node["params"]).abs().max().item())
        assert a["bytes"] == node["bytes"] > 0, (kind, rank, a["bytes"], node["bytes"])
    # the model under one key for both nodes: DCP kept one copy, and the run went elsewhere
    assert not all(torch.equal(a["params"], b["global"]["params"])
                   for a, b in zip(straight, resumed))
