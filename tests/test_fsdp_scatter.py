"""ciuicflow.fsdp with a 1-D mesh: FSDP2 sharded over all 4 ranks (2 simulated nodes x 2, gloo),
its reduce-scatter replaced by the compressed one, against FSDP2's own reduce-scatter."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.test_fsdp import TinyLM, _batch, _full, _step, inf_backward, resume_check

METHODS = ("onebit", "int8")
STEPS = 16


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (4,))


def _build(method, mesh, mp=None, **options):
    import ciuicflow.fsdp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    state = ciuicflow.fsdp.register(model, method, mesh=mesh, **options) if method else None
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3), state


def _every_method(rank, world, directory):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh()
    model, optimizer, _ = _build(None, mesh)  # FSDP2's own reduce-scatter: the exact reference
    start = _full(model)
    exact_losses = [_step(model, optimizer, s) for s in range(STEPS)]
    exact = _full(model)
    out = {"moved": (exact - start).abs().max().item(), "exact_losses": exact_losses}
    for method in METHODS:
        model, optimizer, state = _build(method, mesh, warmup_steps=2)
        losses = [_step(model, optimizer, s) for s in range(STEPS)]
        out[method] = {"losses": losses, "gap": (_full(model) - exact).abs().max().item(),
                       "stats": state.stats()}
    # bf16 reduce dtype
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    model, optimizer, state = _build("onebit", mesh, mp=mp, warmup_steps=2)
    out["bf16"] = {"losses": [_step(model, optimizer, s) for s in range(8)], "stats": state.stats()}
    # resume from a DCP checkpoint continues exactly (and not without ciuicflow's state)
    out["resumed_equal_True"], out["resumed_equal_False"], _ = resume_check(
        lambda: _build("onebit", mesh, warmup_steps=1), directory)
    # a non-finite gradient on one rank: that step's reduce-scatter is exact, the memory kept
    model, optimizer, state = _build("onebit", mesh, warmup_steps=0)
    _step(model, optimizer, 0)
    before = {g.name: g.memory.error.clone() for g in state.groups}
    out["nonfinite_grad"] = inf_backward(model, _batch(1), rank)
    out["nonfinite_fallbacks"] = state.stats()["nonfinite_fallbacks"]
    out["memory_kept"] = all(torch.equal(before[g.name], g.memory.error) for g in state.groups)
    return out


def test_compressed_reduce_scatter_against_fsdp2():
    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_every_method, 4, nodes=2, timeout=600,
                                  args=(os.path.join(directory, "ckpt"),))
    r = results[0]
    improvement = r["exact_losses"][0] - r["exact_losses"][-1]
    for method in METHODS:
        m, stats = r[method], r[method]["stats"]
        assert stats["steps"] == STEPS and stats["compressed_steps"] == STEPS - 2, stats
        # Measured (2026-12-02): parameters 0.72 (1-bit) and 0.045 (int8) of how far exact training
        # moved them, final loss 1.8% and 0.02% of exact training's improvement. A reduce-scatter
        # that keeps only its own row (drops what it receives): 0.91 and 17%.
        bound = 0.1 if method == "int8" else 0.8
        assert 0 < m["gap"] < bound * r["moved"], (method, m["gap"], r["moved"])
        assert abs(m["losses"][-1] - r["exact_losses"][-1]) < 0.08 * improvement, (method, m)
    assert r["onebit"]["stats"]["compression_ratio"] > 20, r["onebit"]["stats"]
    assert 3 < r["int8"]["stats"]["compression_ratio"] < 4.01, r["int8"]["stats"]
    bf16 = r["bf16"]
    assert bf16["stats"]["compressed_steps"] == 6 and all(map(lambda x: x == x, bf16["losses"]))
    assert abs(bf16["losses"][-1] - r["exact_losses"][7]) < 0.1 * r["exact_losses"][0], bf16
    for x in results:
        assert x["resumed_equal_True"], "a resumed run must continue exactly"
        assert not x["resumed_equal_False"], "without the saved memory it differs: teeth"
        assert x["nonfinite_fallbacks"] >= 1 and x["memory_kept"] and x["nonfinite_grad"]


def _refusals(rank, world):
    import ciuicflow.fsdp

    mesh = _mesh()
    model, _, _ = _build(None, mesh)
    errors = {}
    for method, options in (("hierarchical_1bit", {}), ("powersgd", {}),
                            ("onebit", {"exclude": ["*bias"]})):
        with pytest.raises(ValueError) as caught:
            ciuicflow.fsdp.register(model, method, mesh=mesh, **options)
        errors[method] = str(caught.value)
    return errors


def test_one_dimensional_mesh_refuses_what_it_cannot_do():
    errors = run_distributed(_refusals, 4, nodes=2, timeout=300)[0]
    assert "1-D mesh" in errors["hierarchical_1bit"] and "onebit" in errors["hierarchical_1bit"]
    assert "1-D mesh" in errors["powersgd"]
    assert "exclude" in errors["onebit"]
