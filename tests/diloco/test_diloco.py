"""ciuicflow.diloco on real gloo processes: 2 simulated nodes x 2 ranks, DDP inside each node.

Each node starts from its own random weights (DiLoCo must make them equal), and each rank draws
its own batches, so the nodes' replicas drift apart between outer steps.
"""
import argparse
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.diloco.delayed import one_delayed_sync
from tests.dist_utils import run_distributed

H = 4  # sync_every


def _setup(rank, **options):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow.diloco as diloco

    node = rank // 2
    torch.manual_seed(100 + node)  # the nodes start apart; the node's ranks alike
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    ddp = DDP(model, process_group=diloco.node_group())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    options.setdefault("sync_every", H)
    return model, ddp, optimizer, diloco.DiLoCo(ddp, **options)


def _inner_step(ddp, optimizer, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=gen)
    y = torch.randint(0, 3, (8,), generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _all_equal(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(g, gathered[0]) for g in gathered)


# -- replicas ------------------------------------------------------------------------------------


def _replicas(rank, world, codec, fragments, delay):
    model, ddp, optimizer, diloco = _setup(rank, codec=codec, fragments=fragments,
                                           fragment_sync_delay=delay)
    report = {"start_equal": _all_equal(_flat(model)), "after_apply": [], "between": []}
    for step in range(1, 3 * H + 1):
        _inner_step(ddp, optimizer, rank, step)
        diloco.step()
        applied = diloco.schedule.sends_at(step - delay) if step > delay else []
        for k in applied:
            report["after_apply"].append(
                (step, k, _all_equal(diloco.fragments[k].read()), _all_equal(diloco.anchors[k])))
        if not applied:
            report["between"].append(_all_equal(_flat(model)))
    diloco.sync()
    report["after_sync"] = _all_equal(_flat(model))
    report["stats"] = diloco.stats()
    diloco.close()
    return report


@pytest.mark.parametrize("codec, fragments, delay", [("int8", 1, 0), ("int4", 2, 1)],
                         ids=["int8-whole", "int4-streaming"])
def test_replicas_bit_identical_after_each_outer_step(codec, fragments, delay):
    report = run_distributed(_replicas, 4, nodes=2, args=(codec, fragments, delay))[0]
    assert report["start_equal"]
    from ciuicflow.diloco.layout import Schedule

    schedule = Schedule(H, fragments, delay)  # those sent in the last `delay` steps land in sync()
    assert len(report["after_apply"]) == sum(len(schedule.sends_at(s - delay))
                                             for s in range(delay + 1, 3 * H + 1))
    for step, k, params_equal, anchors_equal in report["after_apply"]:
        assert params_equal and anchors_equal, (step, k)
    assert not all(report["between"])  # the nodes did drift: equality above is DiLoCo's doing
    assert report["after_sync"]
    stats = report["stats"]
    assert stats["fragment_syncs"] == 3 * fragments + fragments  # the schedule's and sync()'s
    assert stats["outer_steps"] == 4 and stats["skipped_outer_steps"] == 0
    assert stats["wire_plan"].startswith(codec)
    assert stats["inter_node_bytes"] > 0
    assert 0.0 <= stats["network_wait_share"] <= 1.0


def _keep_progress(rank, world):
    model, ddp, optimizer, diloco = _setup(rank, codec="exact", fragment_sync_delay=1,
                                           keep_local_progress=True)
    at_send, before_apply, after = one_delayed_sync(
        diloco, lambda step: _inner_step(ddp, optimizer, rank, step), lambda: _flat(model), H)
    anchor = diloco.anchors[0].detach().clone()
    gathered = [torch.empty_like(at_send) for _ in range(world)]
    dist.all_gather(gathered, at_send)
    report = {"kept": torch.equal(after, (before_apply - at_send).add_(anchor)),
              "moved": (before_apply - at_send).abs().max().item(),
              "anchor_is_mean": (anchor - torch.stack(gathered).mean(0)).abs().max().item(),
              "anchors_equal": _all_equal(anchor), "replicas_equal": _all_equal(after),
              "stats": diloco.stats()}
    diloco.sync()
    report["after_sync"] = _all_equal(_flat(model))
    diloco.close()
    return report


def test_keep_local_progress_adds_the_steps_taken_while_the_sync_was_in_flight():
    for report in run_distributed(_keep_progress, 4, nodes=2):
        # the model after the outer step is the new anchor plus exactly what the inner step
        # after the send moved it (bit for bit: dropping it, or measuring it from the old anchor,
        # gives other values), and the anchor is the mean of the nodes' models at the send
        assert report["kept"] and report["moved"] > 1e-4
        assert report["anchor_is_mean"] < 1e-6
        assert report["anchors_equal"] and not report["replicas_equal"]
        assert report["after_sync"]  # sync() applies with nothing in flight: equal again
        assert report["stats"]["keep_local_progress"] is True


# -- the outer step's arithmetic --------------------------------------------------------------------


def _outer_arithmetic(rank, world):
    import ciuicflow.diloco as diloco_module

    out = {}
    for name, factory in (("average", None), ("nesterov", diloco_module.nesterov(0.7, 0.9))):
        model, ddp, optimizer, diloco = _setup(rank, codec="exact", outer_optimizer=factory)
        anchor = _flat(model)
        for step in range(1, H + 1):
            _inner_step(ddp, optimizer, rank, step)
            if step == H:
                local = _flat(model)
                gathered = [torch.empty_like(local) for _ in range(world)]
                dist.all_gather(gathered, local)
                mean = torch.stack(gathered).mean(0)
            diloco.step()
        delta = anchor - mean
        # SGD: the first step's momentum buffer is the gradient; Nesterov adds it once more
        want = mean if name == "average" else anchor - 0.7 * (delta + 0.9 * delta)
        out[name] = (_flat(model) - want).abs().max().item()
        diloco.close()
    return out


def test_outer_step_is_the_mean_or_nesterov_on_the_mean_pseudo_gradient():
    errors = run_distributed(_outer_arithmetic, 4, nodes=2)[0]
    assert errors["average"] < 1e-6 and errors["nesterov"] < 1e-6, errors


def _default_outer_mean(rank, world):
    """DiLoCo given the inner optimizer and no outer_optimizer: the model after the first outer
    step against anchor - lr x (anchor - the nodes' mean), for SGD and for AdamW."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow.diloco as diloco

    out = {}
    for name, make, lr in (("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 0.9),
                           ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2), 1.0)):
        torch.manual_seed(100 + rank // 2)
        model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
        ddp = DDP(model, process_group=diloco.node_group())
        optimizer = make(ddp.parameters())
        local = {}
        # registered before DiLoCo's own hook: it sees each node's parameters before the outer step
        optimizer.register_step_post_hook(lambda *_: local.update(x=_flat(model)))
        outer = diloco.DiLoCo(ddp, optimizer, codec="exact", sync_every=H)
        anchor = _flat(model)
        for step in range(1, H + 1):
            _inner_step(ddp, optimizer, rank, step)
        gathered = [torch.empty_like(local["x"]) for _ in range(world)]
        dist.all_gather(gathered, local["x"])
        mean = torch.stack(gathered).mean(0)
        want = anchor - lr * (anchor - mean)
        out[name] = (outer.stats()["outer_optimizer"], (_flat(model) - want).abs().max().item())
        outer.close()
    return out


def test_default_outer_step_is_damped_under_sgd_and_the_mean_under_adam():
    import ciuicflow.diloco as diloco

    assert diloco.DEFAULT_SGD_OUTER_LR == 0.9 and diloco.DEFAULT_OUTER_LR == 1.0
    reports = run_distributed(_default_outer_mean, 4, nodes=2)
    for report in reports:
        for name, lr in (("sgd", 0.9), ("adamw", 1.0)):
            description, error = report[name]
            assert description == f"SGD lr {lr:g} (no momentum)", (name, description)
            assert error < 1e-6, (name, error)


def _inner_lr_scaled(rank, world):
    """The first inner step (no sync yet) against a plain optimizer at lr x the expected scale on
    the same gradients; the optimizer's lr as the user set it after the step."""
    import copy
    import math

    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow.diloco as diloco

    out = {}
    for name, make, scale in (
            ("adamw", lambda p, lr=1e-2: torch.optim.AdamW(p, lr=lr), math.sqrt(2)),
            ("sgd", lambda p, lr=0.1: torch.optim.SGD(p, lr=lr, momentum=0.9), 1.0)):
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
        reference = copy.deepcopy(model)
        ddp = DDP(model, process_group=diloco.node_group())
        optimizer = make(ddp.parameters())
        lr = optimizer.param_groups[0]["lr"]
        outer = diloco.DiLoCo(ddp, optimizer, codec="exact", sync_every=H)
        plain = make(reference.parameters(), lr=lr * scale)
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.clone()
        optimizer.step()
        plain.step()
        # a step that raises inside the optimizer: the lr is not scaled twice at the next one
        def fail(*_):  # runs after DiLoCo's pre-hook, as an error inside the step would
            raise RuntimeError("injected")

        failing = optimizer.register_step_pre_hook(fail)
        try:
            optimizer.step()
        except RuntimeError:
            pass
        failing.remove()
        scaled_once = []
        hook = optimizer.register_step_pre_hook(
            lambda opt, *_: scaled_once.append(opt.param_groups[0]["lr"]))
        before = _flat(model)
        optimizer.step()
        hook.remove()
        out[name] = {"gap": (before - _flat(reference)).abs().max().item(),
                     "lr_in_step": scaled_once[0],
                     "lr_after": optimizer.param_groups[0]["lr"], "lr": lr,
                     "stats_scale": outer.stats()["inner_lr_scale"]}
        outer.close()
    return out


def test_inner_lr_is_scaled_by_the_root_of_the_nodes_under_adam_only():
    import math

    for report in run_distributed(_inner_lr_scaled, 4, nodes=2):
        adamw, sgd = report["adamw"], report["sgd"]
        assert adamw["stats_scale"] == math.sqrt(2) and sgd["stats_scale"] == 1.0, report
        for r in (adamw, sgd):
            assert r["gap"] < 1e-7, r  # the step taken at lr x scale
            assert r["lr_after"] == r["lr"], r  # and the user's lr given back, exactly
        # after a step that raised, the next is scaled once, not twice
        assert adamw["lr_in_step"] == pytest.approx(adamw["lr"] * math.sqrt(2), rel=1e-12), adamw
        assert sgd["lr_in_step"] == sgd["lr"], sgd


def _auto_wire(rank, world):
    """DiLoCo's defaults under SGD, AdamW and no optimizer given: what it says it sends, and the
    bytes it counted over two periods."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow.diloco as diloco

    out = {}
    for name, make in (("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                       ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2)), ("none", None)):
        torch.manual_seed(100 + rank // 2)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                    torch.nn.Linear(128, 3))
        ddp = DDP(model, process_group=diloco.node_group())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1) if make is None \
            else make(ddp.parameters())
        outer = diloco.DiLoCo(ddp, None if make is None else optimizer)
        period = outer.sync_every
        for step in range(1, 2 * period + 1):
            _inner_step_wide(ddp, optimizer, rank, step)
            if make is None:
                outer.step()
        stats = outer.stats()
        out[name] = {k: stats[k] for k in ("codec", "sync_every", "wire_reason", "outer_steps",
                                           "inter_node_bytes", "wire_plan")}
        out[name]["numel"] = sum(p.numel() for p in model.parameters())
        outer.close()
    return out


def _inner_step_wide(ddp, optimizer, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    optimizer.step()


def test_auto_sends_one_bit_every_4_steps_under_sgd_and_int4_every_16_otherwise():
    for report in run_distributed(_auto_wire, 4, nodes=2):
        for name, codec, period in (("sgd", "onebit", 4), ("adamw", "int4", 16),
                                    ("none", "int4", 16)):
            r = report[name]
            assert (r["codec"], r["sync_every"], r["outer_steps"]) == (codec, period, 2), r
            assert r["wire_plan"].startswith(codec), r
            assert "codec='auto'" in r["wire_reason"] and "sync_every='auto'" in r["wire_reason"]
            # each rank sends its node's half of the model once per outer step: the codec's
            # bits per element, plus the scales (a float per 256 elements at most)
            bits = 8 * r["inter_node_bytes"] / (2 * r["numel"] / 2)
            want = {"onebit": 1, "int4": 4}[codec]
            assert want <= bits < want + 0.5, (name, bits)


# -- resume ----------------------------------------------------------------------------------------


def _resume(rank, world, path, phase, keep=False):
    import ciuicflow.diloco as diloco_module

    # an outer optimizer with state (momentum buffers), which the checkpoint must carry
    options = dict(codec="int8", fragments=2, fragment_sync_delay=1,
                   outer_optimizer=diloco_module.nesterov(0.7, 0.9), keep_local_progress=keep)
    model, ddp, optimizer, diloco = _setup(rank, **options)
    first, total = 6, 14  # at step 6 fragment 0's sync (sent after step 6) is in flight
    file = os.path.join(path, f"rank{rank}.pt")
    if phase == "resume":
        state = torch.load(file, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        diloco.load_state_dict(state["diloco"])
        start = first
    else:
        start = 0
    for step in range(start + 1, total + 1):
        _inner_step(ddp, optimizer, rank, step)
        diloco.step()
        if phase == "straight" and step == first:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "diloco": diloco.state_dict()}, file)
    diloco.close()
    return _flat(model), diloco.stats()["inter_node_bytes"]


@pytest.mark.parametrize("keep", [False, True], ids=["drop", "keep-local-progress"])
def test_resume_from_checkpoint_is_bitwise_exact(tmp_path, keep):
    # with keep_local_progress the sync in flight needs this node's values at its send
    straight = run_distributed(_resume, 4, nodes=2, args=(str(tmp_path), "straight", keep))
    resumed = run_distributed(_resume, 4, nodes=2, args=(str(tmp_path), "resume", keep))
    for rank, ((a, bytes_a), (b, bytes_b)) in enumerate(zip(straight, resumed)):
        assert torch.equal(a, b), (rank, (a - b).abs().max().item())
        assert bytes_a == bytes_b


# -- non-finite pseudo-gradients ------------------------------------------------------------------


def _nonfinite(rank, world):
    model, ddp, optimizer, diloco = _setup(rank, codec="int8")
    caught = []
    for step in range(1, 3 * H + 1):
        _inner_step(ddp, optimizer, rank, step)
        if step == H and rank == 3:  # one rank of one node goes bad just before an outer step
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("inf")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            diloco.step()
        caught += [str(w.message) for w in seen if "non-finite" in str(w.message)]
        if step == H:
            back_to_anchor = torch.equal(_flat(model), diloco.anchors[0])
            equal_after_skip = _all_equal(_flat(model))
    stats = diloco.stats()
    diloco.close()
    return {"warned": len(caught), "skipped": stats["skipped_outer_steps"],
            "outer": stats["fragment_syncs"], "back_to_anchor": back_to_anchor,
            "equal_after_skip": equal_after_skip, "finite": bool(_flat(model).isfinite().all()),
            "equal_at_end": _all_equal(_flat(model))}


def test_nonfinite_pseudo_gradient_skips_the_outer_step_on_every_rank():
    reports = run_distributed(_nonfinite, 4, nodes=2)
    for report in reports:
        assert report["warned"] == 1 and report["skipped"] == 1 and report["outer"] == 2, report
        assert report["back_to_anchor"] and report["equal_after_skip"], report
        assert report["finite"] and report["equal_at_end"], report


# -- bad options -------------------------------------------------------------------------------------


BAD = [
    (dict(sync_every=0), "sync_every"),
    (dict(sync_every=2.5), "sync_every"),
    (dict(sync_every="fast"), "an integer >= 1 or 'auto'"),
    (dict(codec="zstd", sync_every="auto"), "codec must be one of"),
    (dict(fragments=5, sync_every=8), "more than the model's 4"),
    (dict(fragments=3, sync_every=2), "fragments=3 must be <= sync_every"),
    (dict(fragment_sync_delay=4), "fragment_sync_delay=4 must be < sync_every"),
    (dict(fragment_update_alpha=1.0), "fragment_update_alpha"),
    (dict(keep_local_progress="yes"), "keep_local_progress must be True or False"),
    (dict(keep_local_progress=True, fragment_update_alpha=0.5), "give one"),
    (dict(codec="zstd"), "codec must be one of"),
    (dict(codec="powersgd"), "codec must be one of"),
    (dict(codec="exact", codec_options={"chunk_size": 8}), "takes no options"),
    (dict(outer_optimizer=0.7), "factory"),
    (dict(inner_lr_scale=0.0), "inner_lr_scale must be a positive number"),
    (dict(inner_lr_scale="fast"), "inner_lr_scale must be a positive number"),
    (dict(inner_lr_scale=1.5), "needs the inner_optimizer"),
    (dict(ranks_per_node=2), "do not divide into nodes"),
]


def _bad_options(rank, world):
    import ciuicflow.diloco as diloco

    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    messages = []
    for options, _ in BAD:
        options = dict(options)
        options.setdefault("sync_every", 4)
        try:
            diloco.DiLoCo(model, **options)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    try:  # the launch's nodes: 2 ranks and 1
        diloco.DiLoCo(model, sync_every=4)
        messages.append(None)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_bad_options_raise_clear_errors():
    messages = run_distributed(_bad_options, 3, node_sizes=[2, 1])[0]
    for (options, expected), message in zip(BAD, messages):
        assert message is not None and expected in message, (options, message)
    assert messages[-1] is not None and "uneven sizes" in messages[-1]


# -- ciuicflow plan's model ----------------------------------------------------------------------------


def test_plan_models_bytes_per_step_from_the_policy_and_formats():
    from ciuicflow import formats
    from ciuicflow.plan.diloco_model import diloco
    from ciuicflow.plan.inputs import ClusterSpec, Workload

    cluster = ClusterSpec(2, 4, 100e9, 1.25e9)
    work = Workload(1_024_000, compute_seconds=0.1)
    int8 = diloco(cluster, work, 16, codec="int8")
    # two nodes: one phase, each rank sends its shard (1/4) once; the node's 4 ranks share the link
    shard = 1_024_000 / 4
    assert int8.inter_bytes_per_sync == pytest.approx(4 * shard * formats.bytes_per_element("int8", 256))
    assert int8.inter_bytes_per_step == pytest.approx(int8.inter_bytes_per_sync / 16)
    exact = diloco(cluster, work, 16, codec="exact")
    assert exact.inter_bytes_per_sync == pytest.approx(4 * shard * 4)  # a 2-rank ring: once
    # fragments split the bytes, not add to them; a delay hides the sync behind inner steps
    streamed = diloco(cluster, work, 16, fragments=4, delay=3, codec="int8")
    assert streamed.inter_bytes_per_step == pytest.approx(int8.inter_bytes_per_step)
    assert streamed.exposed_seconds_per_step < int8.exposed_seconds_per_step
    # the local work is never hidden: the codec's passes over the shard and DiLoCo's own over the
    # fragment, costed per element as the hooks' compressors are
    from ciuicflow.plan.diloco_model import OWN_PASSES

    slow = Workload(1_024_000, compute_seconds=0.1, local_seconds_per_element=5e-9)
    cpu = diloco(cluster, slow, 16, codec="int8")
    assert cpu.local_seconds == pytest.approx((shard + OWN_PASSES * 1_024_000) * 5e-9)
    assert cpu.exposed_seconds_per_step == pytest.approx(
        int8.exposed_seconds_per_step + (cpu.local_seconds - int8.local_seconds) / 16)
    hidden = diloco(cluster, slow, 16, fragments=4, delay=3, codec="int8")
    assert hidden.exposed_seconds_per_step == pytest.approx(4 * hidden.local_seconds / 16)
    assert diloco(cluster, slow, 16, codec="exact").local_seconds == \
        pytest.approx(OWN_PASSES * 1_024_000 * 5e-9)  # no codec
    with pytest.raises(ValueError):
        diloco(cluster, work, 4, fragments=5)
    with pytest.raises(ValueError):
        diloco(cluster, work, 4, codec="powersgd")


def test_plan_auto_models_what_diloco_auto_sends(capsys):
    from ciuicflow.plan import cli

    rows = {}
    for optimizer in ("sgd", "adam"):
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(["--model", "1e9", "--nodes", "2", "--gpus-per-node", "4",
                                  "--optimizer", optimizer, "--diloco", "auto,2"])
        assert cli.run(args) == 0
        rows[optimizer] = [line for line in capsys.readouterr().out.splitlines()
                           if line.startswith("| diloco ")]
    assert rows["sgd"][0].startswith("| diloco onebit H=4 "), rows
    assert rows["sgd"][1].startswith("| diloco onebit H=2 "), rows
    assert rows["adam"][0].startswith("| diloco int4 H=16 "), rows


# -- the monitor ------------------------------------------------------------------------------------


def _monitored(rank, world):
    from ciuicflow.monitor.monitor import Monitor

    model, ddp, optimizer, diloco = _setup(rank, codec="int8")
    records = []
    with Monitor(None, [diloco], straggler_every=0, hang_timeout_s=None) as mon:
        for step in range(1, 2 * H + 1):
            mon.step_begin()
            _inner_step(ddp, optimizer, rank, step)
            diloco.step()
            records.append(mon.step_end())
    stats = diloco.stats()
    diloco.close()
    return {"records": [{k: r.get(k) for k in ("inter_node_bytes", "exact_inter_node_bytes",
                                               "inter_node_compression_ratio", "comm_s")}
                        for r in records], "stats": stats}


def test_monitor_reads_bytes_per_outer_step_and_network_wait():
    for report in run_distributed(_monitored, 4, nodes=2):
        records, stats = report["records"], report["stats"]
        syncs = [r for step, r in enumerate(records, 1) if step % H == 0]
        between = [r for step, r in enumerate(records, 1) if step % H]
        assert all(r["inter_node_bytes"] == 0 for r in between), between
        assert all(r["inter_node_bytes"] > 0 and r["comm_s"] > 0 for r in syncs), syncs
        assert sum(r["inter_node_bytes"] for r in records) == stats["inter_node_bytes"]
        # exact DDP's bytes every step, so the monitor's ratio over a period is DiLoCo's reduction
        exact = stats["exact_ddp_inter_node_bytes_per_step"]
        assert all(r["exact_inter_node_bytes"] == pytest.approx(exact) for r in records)
        assert sum(r["exact_inter_node_bytes"] for r in records) / stats["inter_node_bytes"] == \
            pytest.approx(stats["reduction_vs_exact_ddp"])
