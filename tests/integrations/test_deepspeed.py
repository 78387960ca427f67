"""ciuicflow's OneBitAdam inside DeepSpeed's engine (real gloo processes, 2 simulated nodes x 2),
and the DeepSpeed config planner.

The engine tests are skipped, with the reason shown, when deepspeed is not installed
(``pip install 'ciuicflow[deepspeed]'``, ``DS_BUILD_OPS=0`` without CUDA). The planner needs no
deepspeed.
"""
import importlib.util
import json
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.optim.helpers import CollectiveBytes, _batch, _loss, _mlp, _same_on_every_rank

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed: pip install 'ciuicflow[deepspeed]' (DS_BUILD_OPS=0 without CUDA)")

WORLD, NODES = 4, 2
QUIET = {"steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, **QUIET, **extra}


def _engine(model, optimizer, config):
    import deepspeed
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _engine_steps(engine, rank, steps, accumulation=1, dtype=torch.float32):
    """Train ``steps`` optimizer steps of ``accumulation`` micro-batches; return per-step facts."""
    facts = []
    for step in steps:
        for micro in range(accumulation):
            x, y = _batch(rank, step * accumulation + micro)
            loss = torch.nn.functional.cross_entropy(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
        facts.append({"allreduce": engine.enable_backward_allreduce, "loss": loss.item()})
    return facts


def _plain_steps(model, optimizer, rank, steps, accumulation=1):
    for step in steps:
        optimizer.zero_grad()
        for micro in range(accumulation):
            (_loss(model, _batch(rank, step * accumulation + micro)) / accumulation).backward()
        optimizer.step()


def _max_gap(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# -- the engine gives the same results as no engine, sends each gradient once, and resumes ----------


def _engine_matches_plain(rank, world, checkpoint_dir):
    import deepspeed  # noqa: F401  (imported before the optimizer is built, as users do)
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam

    freeze, steps = 4, 10

    def optimizer_for(model):
        return OneBitAdam(model.parameters(), lr=1e-2, freeze_steps=freeze, hold_until_stable=False,
                          hierarchical=False)

    report = {}
    plain = _mlp(5)
    _plain_steps(plain, optimizer_for(plain), rank, range(steps))

    model = _mlp(5)
    engine = _engine(model, optimizer_for(model), _config())
    with CollectiveBytes() as log:
        per_step = []
        for step in range(steps):
            start = len(log.records)
            facts = _engine_steps(engine, rank, [step])[0]
            per_step.append(dict(facts, bytes=log.total(start)))
            if step == 5:
                engine.save_checkpoint(checkpoint_dir, tag="step6")
    report["flags"] = [f["allreduce"] for f in per_step]
    report["bytes"] = [f["bytes"] for f in per_step]
    report["params"] = sum(p.numel() for p in model.parameters())
    report["gap_to_plain"] = _max_gap(engine.module.parameters(), plain.parameters())
    report["in_sync"] = _same_on_every_rank(list(engine.module.parameters()))
    straight = [p.detach().clone() for p in engine.module.parameters()]

    # a fresh engine resumed from the checkpoint continues exactly
    model = _mlp(6)  # other weights: the checkpoint must overwrite them
    resumed = _engine(model, optimizer_for(model), _config())
    resumed.load_checkpoint(checkpoint_dir, tag="step6")
    report["resumed_flag"] = resumed.enable_backward_allreduce
    _engine_steps(resumed, rank, range(6, steps))
    report["resume_gap"] = _max_gap(resumed.module.parameters(), straight)

    # gradient accumulation: 2 micro-batches per step, against accumulating by hand
    plain = _mlp(7)
    _plain_steps(plain, optimizer_for(plain), rank, range(steps), accumulation=2)
    model = _mlp(7)
    accumulating = _engine(model, optimizer_for(model), _config(gradient_accumulation_steps=2))
    _engine_steps(accumulating, rank, range(steps), accumulation=2)
    report["accumulation_gap"] = _max_gap(accumulating.module.parameters(), plain.parameters())

    # 0/1 Adam: the engine all-reduces exactly the variance steps' gradients (1, 2, 4, 6), the
    # optimizer sends 1-bit gradients (3, 5), then 1-bit syncs of local steps (7, 8, 10), not 9
    def zero_one_for(model):
        return ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=6, hold_until_stable=False,
                           var_update_scaler=2,
                           local_step_scaler=2, local_step_clipper=2, hierarchical=False,
                           warmup_steps=0)

    plain = _mlp(11)
    _plain_steps(plain, zero_one_for(plain), rank, range(steps))
    model = _mlp(11)
    engine = _engine(model, zero_one_for(model), _config())
    with CollectiveBytes() as log:
        zero_one = []
        for step in range(steps):
            start = len(log.records)
            facts = _engine_steps(engine, rank, [step])[0]
            zero_one.append((facts["allreduce"], log.total(start)))
    report["zero_one"] = zero_one
    report["zero_one_gap"] = _max_gap(engine.module.parameters(), plain.parameters())
    return report


@needs_deepspeed
def test_engine_matches_plain_sends_gradients_once_and_resumes(tmp_path):
    """OneBitAdam (and, at the end, ZeroOneAdam) with and without DeepSpeed's engine."""
    results = run_distributed(_engine_matches_plain, WORLD, nodes=NODES, args=(str(tmp_path),),
                              timeout=400)
    for rank, r in enumerate(results):
        # DeepSpeed all-reduces during warm-up, then stops: its flag follows the optimizer's freeze
        assert r["flags"] == [True] * 3 + [False] * 7, r["flags"]
        # same seeds, same results (DeepSpeed sums then divides where ciuicflow divides first)
        assert r["gap_to_plain"] < 1e-5, r["gap_to_plain"]
        assert r["accumulation_gap"] < 1e-5, r["accumulation_gap"]
        assert r["in_sync"]
        exact = 4 * r["params"]
        assert all(b >= exact for b in r["bytes"][:4])  # the engine's exact all-reduce
        for b in r["bytes"][4:]:  # after warm-up: only the compressed momentum, gradients not re-sent
            # 1 bit an element and a float32 scale per 256 elements, padded: 15x on this
            # 676-element model (an uncompressed momentum would send >= exact)
            assert b <= exact / 12, (b, exact, r["bytes"])
        assert r["resume_gap"] == 0.0, f"rank {rank}: resumed run differs by {r['resume_gap']}"
        assert r["resumed_flag"] is False  # the loaded state is frozen: the engine stays quiet
        flags = [flag for flag, _ in r["zero_one"]]  # after each step: all-reduce the next one?
        assert flags == [True, False, True, False, True] + [False] * 5, flags
        for step, (_, sent) in enumerate(r["zero_one"], 1):
            if step in (1, 2, 4, 6):
                assert sent >= exact
            elif step == 9:
                assert sent == 0
            else:
                assert 0 < sent <= exact / 12, (step, sent)  # 15x here, as above
        assert r["zero_one_gap"] < 1e-5, r["zero_one_gap"]
    print(f"\nbytes handed to collectives per step, rank 0: {results[0]['bytes']} "
          f"({results[0]['params']} parameters)")


# -- bf16 --------------------------------------------------------------------------------------------


def _bf16(rank, world):
    import deepspeed  # noqa: F401
    from ciuicflow.optim import OneBitAdam

    model = _mlp(8).to(torch.bfloat16)
    optimizer = OneBitAdam(model.parameters(), lr=1e-2, freeze_steps=3, hold_until_stable=False)
    engine = _engine(model, optimizer, _config(bf16={"enabled": True}))
    world_group_bytes = []  # DeepSpeed's traffic; the optimizer's goes over the node subgroups
    with CollectiveBytes() as log:
        facts = []
        for step in range(8):
            start = len(log.records)
            facts += _engine_steps(engine, rank, [0], dtype=torch.bfloat16)  # one batch, learnable
            world_group_bytes.append(sum(b for _, g, b in log.records[start:]
                                         if g is None or dist.get_world_size(g) == world))
    return {"wrapper": type(engine.optimizer).__name__, "steps_taken": optimizer.steps_taken,
            "global_steps": engine.global_steps, "losses": [f["loss"] for f in facts],
            "in_sync": _same_on_every_rank(list(engine.module.parameters())),
            "world_bytes": world_group_bytes, "params": sum(p.numel() for p in model.parameters())}


@needs_deepspeed
def test_bf16_engine_trains_in_sync_without_deepspeed_allreduce():
    for r in run_distributed(_bf16, WORLD, nodes=NODES, timeout=300):
        assert r["wrapper"] == "FP16_UnfusedOptimizer"  # DeepSpeed's bf16 path for ZeRO 0
        # the wrapper's state-allocating step at initialize was skipped: counts match the engine's
        assert r["steps_taken"] == r["global_steps"] == 8
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3])
        assert r["in_sync"]
        # DeepSpeed all-reduces the bf16 gradients during warm-up; after it the world group only
        # carries its wrapper's 1-byte overflow flag
        assert all(b >= 2 * r["params"] for b in r["world_bytes"][:3]), r["world_bytes"]
        assert all(b <= 8 for b in r["world_bytes"][3:]), r["world_bytes"]


# -- what cannot combine is refused at initialize -----------------------------------------------------


def _refusals(rank, world):
    import deepspeed  # noqa: F401
    from ciuicflow.integrations.deepspeed import UnsupportedDeepSpeedConfig
    from ciuicflow.optim import OneBitAdam

    def attempt(**config):
        model = _mlp(9)
        try:
            _engine(model, OneBitAdam(model.parameters(), freeze_steps=2), _config(**config))
        except UnsupportedDeepSpeedConfig as exc:
            return str(exc)
        return None

    messages = {f"zero{stage}": attempt(zero_optimization={"stage": stage},
                                        zero_allow_untested_optimizer=True)
                for stage in (1, 2, 3)}
    messages["autocast+zero2"] = attempt(torch_autocast={"enabled": True, "dtype": "bfloat16"},
                                         zero_optimization={"stage": 2},
                                         zero_allow_untested_optimizer=True)
    messages["sum"] = attempt(gradient_allreduce_op="sum")
    model = _mlp(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine(model, OneBitAdam(model.parameters(), freeze_steps=2),
                         {"train_micro_batch_size_per_gpu": 8, **QUIET})  # DeepSpeed's clip: 1.0
    messages["clip_warning"] = [str(w.message) for w in caught if "gradient_clipping" in str(w.message)]
    messages["clip_accepted"] = engine.gradient_clipping()
    return messages


@needs_deepspeed
def test_unsupported_deepspeed_features_are_refused_with_reasons():
    messages = run_distributed(_refusals, 1, nodes=1, timeout=300)[0]
    for stage in (1, 2, 3):
        assert f"ZeRO stage {stage}" in messages[f"zero{stage}"], messages[f"zero{stage}"]
        assert "stage to 0" in messages[f"zero{stage}"]
    both = messages["autocast+zero2"]
    assert "ZeRO stage 2" in both and "torch_autocast" in both  # every conflict, in one error
    assert "gradient_allreduce_op" in messages["sum"]
    assert messages["clip_accepted"] == 1.0 and messages["clip_warning"]


# -- the config planner -------------------------------------------------------------------------------


def _cluster(nodes=2, gpus=8):
    from ciuicflow.plan import ClusterSpec
    return ClusterSpec(nodes, gpus, intra_bw=600e9, inter_bw=25e9)


def test_planner_picks_the_lowest_zero_stage_that_fits():
    from ciuicflow.integrations.deepspeed import deepspeed_config, model_state_memory

    gib = 2 ** 30
    small = deepspeed_config(125e6, _cluster(), gpu_memory=80 * gib)
    assert small.zero_stage == 0 and not small.offload_optimizer
    # 7B in bf16: 16 bytes per parameter = 112 GB replicated; ZeRO 1 over 16 GPUs = 28 + 5.25 GB
    big = deepspeed_config(7e9, _cluster(), gpu_memory=80 * gib)
    assert big.zero_stage == 1
    assert big.memory.gpu_total == pytest.approx(4 * 7e9 + 12 * 7e9 / 16)
    assert big.config["zero_optimization"] == {"stage": 1}
    assert big.config["bf16"] == {"enabled": True}
    # less memory: ZeRO 2, then 2 + optimizer offload, then 3 ...
    stages = [deepspeed_config(7e9, _cluster(), gpu_memory=m * gib) for m in (30, 16, 10, 3)]
    assert [(p.zero_stage, p.offload_optimizer, p.offload_param) for p in stages] == [
        (2, False, False), (2, True, False), (3, False, False), (3, True, False)]
    for plan, memory in zip(stages, (30, 16, 10, 3)):  # fits in the 90% it may use
        assert plan.memory.gpu_total <= 0.9 * memory * gib
    assert stages[1].config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError, match="do not fit"):
        deepspeed_config(70e9, _cluster(1, 1), gpu_memory=8 * gib)
    # the memory model itself: ZeRO 3 partitions everything
    z3 = model_state_memory(1e9, 8, 3, False, False, "bf16")
    assert z3.gpu_total == pytest.approx(16e9 / 8)


def test_planner_onebit_config_and_accumulation_from_the_communication_model(tmp_path):
    from ciuicflow.integrations.deepspeed import deepspeed_config
    from ciuicflow.plan import Workload, estimate

    gib = 2 ** 30
    cluster = _cluster()
    exact = deepspeed_config(1e9, cluster, gpu_memory=80 * gib, compute_seconds=0.05,
                             max_comm_share=0.1)
    comm = estimate("hierarchical", cluster, Workload(1e9, 0.0, grad_bytes=2)).comm_seconds
    assert exact.comm_seconds_per_step == pytest.approx(comm)
    k = exact.gradient_accumulation_steps
    share = lambda a: comm / (a * 0.05 + comm)  # noqa: E731
    assert share(k) <= 0.1 < share(k - 1)  # the fewest accumulation steps that meet the share
    assert exact.config["train_batch_size"] == k * 16

    onebit = deepspeed_config(1e9, cluster, gpu_memory=80 * gib, compute_seconds=0.05,
                              onebit=True, path=str(tmp_path / "ds.json"))
    assert onebit.zero_stage == 0 and onebit.memory.error_feedback > 0
    assert onebit.gradient_accumulation_steps < k  # 1-bit communication needs less hiding
    assert json.loads((tmp_path / "ds.json").read_text()) == onebit.config
    assert onebit.config["gradient_clipping"] == 0.0 and "optimizer" not in onebit.config
    with pytest.raises(ValueError, match="ZeRO stage 0"):
        deepspeed_config(7e9, cluster, gpu_memory=80 * gib, onebit=True)
    with pytest.raises(ValueError, match="multiple"):
        deepspeed_config(1e9, cluster, gpu_memory=80 * gib, micro_batch=3, global_batch=100)


def _planned_configs_run(rank, world):
    import deepspeed  # noqa: F401
    from ciuicflow.integrations.deepspeed import deepspeed_config
    from ciuicflow.optim import OneBitAdam
    from ciuicflow.plan import ClusterSpec

    cluster = ClusterSpec(1, world, intra_bw=1e9, inter_bw=1e9)
    params = sum(p.numel() for p in _mlp(10).parameters())
    stages = []
    # 676 fp32 parameters over 2 ranks, 90% usable: 10816 B replicated, 8112 B with ZeRO 1,
    # 6760 B with ZeRO 2
    for memory in (1e6, 10_000, 8_000):
        plan = deepspeed_config(params, cluster, gpu_memory=memory, micro_batch=8, precision="fp32")
        model = _mlp(10)
        engine = _engine(model, torch.optim.Adam(model.parameters(), lr=1e-3), {**plan.config, **QUIET})
        _engine_steps(engine, rank, range(2))
        stages.append((plan.zero_stage, engine.zero_optimization_stage()))
    plan = deepspeed_config(params, cluster, gpu_memory=1e6, micro_batch=8, precision="fp32",
                            onebit=True)
    model = _mlp(10)
    engine = _engine(model, OneBitAdam(model.parameters(), freeze_steps=1, hold_until_stable=False),
                     {**plan.config, **QUIET})
    _engine_steps(engine, rank, range(3))
    return stages, engine.enable_backward_allreduce


@needs_deepspeed
def test_planned_configs_run_in_deepspeed():
    stages, allreduce = run_distributed(_planned_configs_run, 2, nodes=2, timeout=300)[0]
    assert stages == [(0, 0), (1, 1), (2, 2)], stages
    assert allreduce is False
