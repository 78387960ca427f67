"""The FSDP tests' model and steps, shared with tests/compression: a tiny transformer LM, its
meshes (2-D for HSDP, 1-D for the compressed reduce-scatter), building it under each method, a
training step, full and local views of its parameters, a resume check and a non-finite backward."""

import torch
import torch.distributed as dist


class TinyLM(torch.nn.Module):
    """Embedding, two transformer layers, a head: several FSDP groups, matrices and vectors."""

    def __init__(self, vocab=32, d=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _build(method, mesh, mp=None, **options):
    """The same weights on every rank; FSDP2 over the node (ciuicflow) or the 2-D mesh (HSDP)."""
    import ciuicflow.fsdp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    shard_on = mesh if method is None else mesh["shard"]
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.layers:
        fully_shard(layer, mesh=shard_on, **kw)
    fully_shard(model, mesh=shard_on, **kw)
    if method == "hierarchical_1bit":  # the 1-bit path: under AdamW the default sends int4
        options.setdefault("adaptive_optimizer", "same")  # (tests/compression/test_optimizer_watch.py)
    state = ciuicflow.fsdp.register(model, method, mesh=mesh, **options) if method else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, optimizer, state


def _batch(step):
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    tokens = torch.randint(0, 32, (4, 12), generator=gen)
    return tokens, torch.roll(tokens, 1, dims=1)  # a learnable target: the previous token


def _step(model, optimizer, step, accumulate=1):
    loss_sum = 0.0
    for micro in range(accumulate):
        model.set_requires_gradient_sync(micro == accumulate - 1)
        tokens, target = _batch(step * accumulate + micro)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        (loss / accumulate).backward()
        loss_sum += loss.item() / accumulate
    optimizer.step()
    optimizer.zero_grad()
    return loss_sum


def _full(model):
    return torch.cat([p.full_tensor().detach().reshape(-1).float() for p in model.parameters()])


def _local(model):
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])


def resume_check(build, directory):
    """Train 4 steps, save to DCP, 4 more; then resume from the checkpoint twice, with and
    without ciuicflow's state. ``build()`` -> (model, optimizer, state). Returns (the run resumed
    with the state equals the straight one, the one without equals it, the resumed state's steps)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer, state = build()
    for s in range(4):
        _step(model, optimizer, s)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd, "ciuicflow": state}, checkpoint_id=directory)
    for s in range(4, 8):
        _step(model, optimizer, s)
    straight = _local(model)
    equal, steps = [], None
    for with_state in (True, False):
        model, optimizer, state = build()
        msd, osd = get_state_dict(model, optimizer)
        loaded = {"model": msd, "optim": osd, **({"ciuicflow": state} if with_state else {})}
        dcp.load(loaded, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                       optim_state_dict=loaded["optim"])
        for s in range(4, 8):
            _step(model, optimizer, s)
        equal.append(torch.equal(_local(model), straight))
        steps = state.stats()["steps"] if with_state else steps
    return equal[0], equal[1], steps


def inf_backward(model, batch, rank) -> bool:
    """Backward of a loss that is inf on rank 0 only; whether a gradient came out non-finite."""
    tokens, target = batch
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
    (loss * (float("inf") if rank == 0 else 1.0)).backward()
    return not all(torch.isfinite(p.grad.to_local()).all() for p in model.parameters())


def _flat_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (4,))


def _build_flat(method, mesh, mp=None, **options):
    """FSDP2 over all ranks (a 1-D mesh), its reduce-scatter replaced by ciuicflow's."""
    import ciuicflow.fsdp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    if method == "onebit":  # the 1-bit path: under AdamW the default sends int4
        options.setdefault("adaptive_optimizer", "same")  # (tests/compression/test_optimizer_watch.py)
    state = ciuicflow.fsdp.register(model, method, mesh=mesh, **options) if method else None
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), state
