"""The DDP hooks on real gloo processes: several buckets in flight, both execution modes, dtypes,
overflow, exclusions, no_sync, static graphs, world size 1, a single node, state handling."""
import copy
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ddp.nets import Net, _batch, _flat_params, _replicas_equal, _step
from tests.dist_utils import run_distributed

HOOKS = ["hierarchical_allreduce", "hierarchical_1bit", "hierarchical_powersgd", "onebit",
         "powersgd"]


def _train(hook, steps=8, dtype=torch.float32, bucket_cap_mb=0.0001, static_graph=False,
           find_unused_parameters=False, **options):
    import ciuicflow

    model = Net(dtype)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, static_graph=static_graph,
              find_unused_parameters=find_unused_parameters)
    state = ciuicflow.register(ddp, hook, **options) if hook else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        _step(ddp, optimizer, dist.get_rank(), step, dtype)
    return model, state


# -- every hook, several buckets in flight ------------------------------------------------------


def _all_hooks(rank, world):
    reference, _ = _train(None)  # DDP's own all-reduce
    out = {}
    for hook in HOOKS:
        for overlap in (True, False):
            options = {"overlap": overlap}
            if hook != "hierarchical_allreduce":
                options["warmup_steps"] = 2
            if "powersgd" in hook:
                options["rank"] = 2  # the default (16) leaves this small model's matrices exact
            model, state = _train(hook, **options)
            params = _flat_params(model)
            out[(hook, overlap)] = {
                "replicas_equal": _replicas_equal(params),
                "gap_to_exact": (params - _flat_params(reference)).abs().max().item(),
                "param_scale": (_flat_params(reference) - _flat_params(Net())).abs().max().item(),
                "finite": bool(torch.isfinite(params).all()),
                "stats": state.stats(),
            }
    return out


def test_every_hook_with_several_buckets_in_flight():
    results = run_distributed(_all_hooks, 4, nodes=2, timeout=240)
    for (hook, overlap), r in results[0].items():
        stats = r["stats"]
        assert r["finite"] and stats["steps"] == 8, (hook, overlap)
        assert stats["buckets"] > 2 * stats["steps"], "expected several buckets per step"
        assert all(rank[(hook, overlap)]["replicas_equal"] for rank in results), (hook, overlap)
        if hook == "hierarchical_allreduce":
            assert r["gap_to_exact"] < 1e-5, r["gap_to_exact"]
            assert stats["inter_node_bytes"] == stats["exact_inter_node_bytes"]
        else:
            assert stats["compressed_steps"] == 6
            assert stats["inter_node_bytes"] < stats["exact_inter_node_bytes"]
            # compressed, yet close to exact training: measured 0.51-0.56 (1-bit) and 0.08
            # (PowerSGD) of how far exact training moved the parameters in these 8 steps
            bound = 0.65 if "1bit" in hook or hook == "onebit" else 0.2
            assert 0 < r["gap_to_exact"] < bound * r["param_scale"], (hook, r["gap_to_exact"])
        if hook.startswith("hierarchical"):  # hierarchical: a quarter of the flat share inter-node
            assert stats["intra_node_bytes"] > 0
    # the same algorithm in both execution modes gives the same numbers
    for hook in HOOKS:
        a, b = results[0][(hook, True)]["stats"], results[0][(hook, False)]["stats"]
        assert a["inter_node_bytes"] == b["inter_node_bytes"]


# -- modes of training --------------------------------------------------------------------------


def _modes(rank, world):
    import ciuicflow

    out = {}
    # no_sync: accumulate two micro-batches, synchronise on the second; only synced steps count
    for hook in ("hierarchical_allreduce", "hierarchical_1bit"):
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.0001)
        state = ciuicflow.register(ddp, hook) if hook != "hierarchical_allreduce" else \
            ciuicflow.register(ddp, hook)
        for step in range(3):
            with ddp.no_sync():
                x, y = _batch(rank, 2 * step)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
            x, y = _batch(rank, 2 * step + 1)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        # the exact answer: every rank's accumulated local gradients, averaged
        local = Net()
        for step in range(3):
            for micro in (2 * step, 2 * step + 1):
                x, y = _batch(rank, micro)
                torch.nn.functional.cross_entropy(local(x), y).backward()
        exact = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
        dist.all_reduce(exact)
        exact /= world
        out[("no_sync", hook)] = {"iter": state.iter,
                                  "gap": (grads - exact).abs().max().item(),
                                  "equal": _replicas_equal(grads)}
    # no_sync with compressed synchronised steps: the accumulated gradient is what is compressed
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = ciuicflow.register(ddp, "hierarchical_1bit", warmup_steps=1)
    local = Net()
    for step in range(3):
        for p in list(model.parameters()) + list(local.parameters()):
            p.grad = None
        with ddp.no_sync():
            x, y = _batch(rank, 2 * step)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            torch.nn.functional.cross_entropy(local(x), y).backward()
        x, y = _batch(rank, 2 * step + 1)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        torch.nn.functional.cross_entropy(local(x), y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    exact = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    dist.all_reduce(exact)
    exact /= world
    # the last micro-batch's gradient alone, for a broken hook that compressed only that
    last = Net()
    torch.nn.functional.cross_entropy(last(x), y).backward()
    last_only = torch.cat([p.grad.reshape(-1) for p in last.parameters()])
    dist.all_reduce(last_only)
    last_only /= world
    cosine = torch.nn.functional.cosine_similarity
    out["no_sync_compressed"] = {
        "compressed": state.stats()["compressed_steps"], "equal": _replicas_equal(grads),
        "cosine": cosine(grads, exact, dim=0).item(),
        "cosine_last_only": cosine(grads, last_only, dim=0).item(),
        "gap": (grads - exact).abs().max().item()}
    # static_graph=True; find_unused_parameters=True (DDP then all-reduces its own bitmap right
    # after the last bucket's hook: it must come after the hooks' collectives on every rank)
    for hook in ("hierarchical_1bit", "hierarchical_powersgd"):
        for mode in ("static", "find_unused"):
            extra = {"rank": 2} if "powersgd" in hook else {}
            model, state = _train(hook, static_graph=mode == "static",
                                  find_unused_parameters=mode == "find_unused", warmup_steps=2,
                                  **extra)
            plain, _ = _train(hook, warmup_steps=2, **extra)
            exact, _ = _train(None, static_graph=mode == "static",
                              find_unused_parameters=mode == "find_unused")
            out[(mode, hook)] = {"equal": _replicas_equal(_flat_params(model)),
                                 "compressed": state.stats()["compressed_steps"],
                                 # the same hook without the mode
                                 "gap_to_plain": (_flat_params(model)
                                                  - _flat_params(plain)).abs().max().item(),
                                 # DDP's exact all-reduce in the same mode, in units of how far
                                 # that moved the parameters
                                 "gap_to_exact": (_flat_params(model) - _flat_params(exact)
                                                  ).abs().max().item() / (_flat_params(exact)
                                                  - _flat_params(Net())).abs().max().item()}
    # state=None: a default state is built on first use
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(None, ciuicflow.hierarchical_powersgd)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(12):
        _step(ddp, optimizer, rank, step)
    default = ciuicflow.ddp.default_state("hierarchical_powersgd")
    out["default_state"] = {"iter": default.iter, "topology": default.topology.describe(),
                            "equal": _replicas_equal(_flat_params(model)),
                            "compressed": default.stats()["compressed_steps"]}
    # an empty bucket (DDP does not make one here; the hooks' bucket path is fed one directly)
    import ciuicflow.ddp
    from ciuicflow.ddp.bucket import BucketView
    for state in (ciuicflow.AllReduceState(), ciuicflow.OneBitState(warmup_steps=0),
                  ciuicflow.PowerSGDState(warmup_steps=0)):
        for route in ("hierarchical", "flat"):
            empty = BucketView(0, torch.empty(0), True, [], [])
            assert state._reduce_bucket(empty, 0, route).numel() == 0
    out["empty"] = _replicas_equal(torch.ones(3))  # every rank got here, none hung
    return out


def test_no_sync_static_graph_unused_parameters_and_default_state():
    for r in run_distributed(_modes, 4, nodes=2, timeout=240):
        for hook in ("hierarchical_allreduce", "hierarchical_1bit"):
            result = r[("no_sync", hook)]
            assert result["iter"] == 3 and result["equal"]
        # exact hook: accumulated gradients are exactly averaged (warm-up covers 1-bit here too)
        assert r[("no_sync", "hierarchical_allreduce")]["gap"] < 1e-6
        assert r[("no_sync", "hierarchical_1bit")]["gap"] < 1e-6
        compressed = r["no_sync_compressed"]
        assert compressed["compressed"] == 2 and compressed["equal"] and compressed["gap"] > 0
        # measured 0.68 against 0.49 for the last micro-batch alone: what was compressed is the
        # accumulated gradient (plus the memory of the step before)
        assert compressed["cosine"] > 0.55, compressed
        assert compressed["cosine"] > compressed["cosine_last_only"] + 0.1, compressed
        for hook in ("hierarchical_1bit", "hierarchical_powersgd"):
            for mode in ("static", "find_unused"):
                assert r[(mode, hook)]["equal"] and r[(mode, hook)]["compressed"] == 6, (mode, hook)
                result = r[(mode, hook)]
                # static_graph keeps DDP's buckets: bit for bit the plain run. With
                # find_unused_parameters DDP does not rebuild its buckets after the first step, so
                # compression sees other buckets; both stay as close to exact as plain runs
                # (measured 0.35-0.51 for 1-bit, 0.11-0.12 for PowerSGD at rank 2)
                if mode == "static":
                    assert result["gap_to_plain"] < 1e-6, (mode, hook, result)
                assert 0 < result["gap_to_exact"] < 0.65, (mode, hook, result)
        assert r["empty"]
        default = r["default_state"]
        assert default["iter"] == 12 and default["equal"] and default["compressed"] == 2
        assert default["topology"].startswith("2 node(s) x 2 rank(s)")


def _two_models_default_states(rank, world):
    """Two models with the hook's default state (state=None) against the same with a state each:
    a GAN-like pair of different layouts stepped one after the other, and two same-layout models
    reduced in one backward pass."""
    import ciuicflow
    import ciuicflow.ddp

    def data(step, which):
        gen = torch.Generator().manual_seed(1000 * rank + 10 * step + which)
        return torch.randn(16, 20, generator=gen)

    def build(case):
        torch.manual_seed(0)
        second = 48 if case == "separate" else 64  # other layouts / the same
        return [torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 20)),
                torch.nn.Sequential(torch.nn.Linear(20, second), torch.nn.Tanh(),
                                    torch.nn.Linear(second, 20))]

    out = {}
    for case in ("separate", "together", "together_unused"):
        for mode in ("default", "own"):
            ciuicflow.ddp.hooks._DEFAULT_STATES.clear()
            # several buckets each; with find_unused_parameters from the first step on
            models = [DDP(m, bucket_cap_mb=0.002, find_unused_parameters=case == "together_unused")
                      for m in build(case)]
            for m in models:
                m.register_comm_hook(None if mode == "default" else ciuicflow.OneBitState(),
                                     ciuicflow.hierarchical_1bit)
            optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
            for step in range(14):
                for o in optimizers:
                    o.zero_grad()
                losses = [m(data(step, i)).square().mean() for i, m in enumerate(models)]
                if case == "separate":  # one backward per model, as a GAN's two players
                    for loss in losses:
                        loss.backward()
                else:
                    sum(losses).backward()
                for o in optimizers:
                    o.step()
            out[(case, mode)] = torch.cat([p.detach().reshape(-1) for m in models
                                           for p in m.parameters()])
            if mode == "default":
                states = [ciuicflow.ddp.default_state("hierarchical_1bit", m.module)
                          for m in models]
                out[(case, "states")] = {"distinct": states[0] is not states[1],
                                         "iters": [s.iter for s in states],
                                         "compressed": [s.stats()["compressed_steps"]
                                                        for s in states]}
    return out


def test_two_models_with_the_default_state_train_as_with_their_own():
    """state=None gives each model its own default state: the same bits as a state per model,
    also where DDP's first step has several buckets per model (find_unused_parameters) and the
    two models are reduced in one backward pass. (One state for both advanced its step counter
    twice per step, ending warm-up at step 5, and dropped each model's error memory whenever the
    other model's step ended.)"""
    for r in run_distributed(_two_models_default_states, 4, nodes=2, timeout=240):
        for case in ("separate", "together", "together_unused"):
            assert torch.equal(r[(case, "default")], r[(case, "own")]), case
            states = r[(case, "states")]
            assert states == {"distinct": True, "iters": [14, 14], "compressed": [4, 4]}, states


def _default_state_lifetime(rank, world):
    """A model with state=None and DDP's find_unused_parameters (whose first step already has
    several buckets) against its own state; then whether its default state goes with it."""
    import gc
    import weakref

    import ciuicflow

    def train(state):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 20))
        ddp = DDP(model, bucket_cap_mb=0.002, find_unused_parameters=True)
        ddp.register_comm_hook(state, ciuicflow.hierarchical_1bit)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(14):
            gen = torch.Generator().manual_seed(rank * 1000 + step)
            optimizer.zero_grad()
            ddp(torch.randn(16, 20, generator=gen)).square().mean().backward()
            optimizer.step()
        return model, ddp, optimizer

    ciuicflow.ddp.hooks._DEFAULT_STATES.clear()
    own = torch.cat([p.detach().reshape(-1) for p in train(ciuicflow.OneBitState())[0].parameters()])
    model, ddp, optimizer = train(None)  # last: the hooks' worker thread ran its last bucket
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state = ciuicflow.ddp.default_state("hierarchical_1bit", model)
    out = {"same": torch.equal(params, own), "iter": state.iter,
           "compressed": state.stats()["compressed_steps"]}
    alive = weakref.ref(state)
    del model, ddp, optimizer, state
    gc.collect()
    out["freed"] = alive() is None
    out["last"] = ciuicflow.ddp.default_state("hierarchical_1bit") is None
    return out


def test_a_default_state_trains_with_several_first_buckets_and_goes_with_its_model():
    """find_unused_parameters: DDP's first step has several buckets, all of them this model's.
    Deleting the model frees its default state and error memories (they were once kept for the
    life of the process, and the hooks' worker thread kept its last bucket's parameters)."""
    for r in run_distributed(_default_state_lifetime, 4, nodes=2, timeout=240):
        assert r == {"same": True, "iter": 14, "compressed": 4, "freed": True, "last": True}, r


# -- dtypes, overflow, exclusions ------------------------------------------------------------------


def _dtypes(rank, world):
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for hook in HOOKS:
            options = {} if hook == "hierarchical_allreduce" else {"warmup_steps": 1}
            if "powersgd" in hook:
                options["rank"] = 2  # the default (16) leaves this small model's matrices exact
            model, state = _train(hook, steps=12, dtype=dtype, **options)
            params = _flat_params(model)
            out[(str(dtype), hook)] = (_replicas_equal(params), bool(torch.isfinite(params).all()),
                                       state.stats()["steps"])
            # against DDP's exact all-reduce in the same dtype: the gap, in units of how far
            # exact training moved the parameters, and the direction of the move
            reference = _flat_params(_train(None, steps=12, dtype=dtype)[0])
            out[("gap", str(dtype), hook)] = _gap_and_direction(params, reference, Net(dtype))
    return out


def _gap_and_direction(params, reference, start):
    """(max |params - reference| / max |reference - start|, cosine between the two moves)."""
    start = _flat_params(start)
    moved = (reference - start).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(params - start, reference - start, dim=0)
    return (params - reference).abs().max().item() / moved, float(cosine)


# Measured over 12 steps (warm-up 1): exact in half precision gap <= 0.035; 1-bit gap
# 0.36-0.47 and cosine 0.83-0.95; PowerSGD (rank 2) gap 0.14-0.17, cosine 0.94-0.95. A hook that
# sends zeros after warm-up: gap 0.54-0.60, cosine 0.55-0.57 (fails the cosine bound).
GAP_BOUND = {"hierarchical_allreduce": 0.06, "hierarchical_powersgd": 0.3, "powersgd": 0.3}
MIN_COSINE = 0.75


def _check_gap(hook, gap, cosine):
    assert gap < GAP_BOUND.get(hook, 0.55), (hook, gap)
    if hook != "hierarchical_allreduce":
        assert gap > 0.0, hook  # compression did change something
        assert cosine > MIN_COSINE, (hook, cosine)


def test_half_precision_buckets():
    for r in run_distributed(_dtypes, 4, nodes=2, timeout=240):
        for key, value in r.items():
            if key[0] == "gap":
                _check_gap(key[2], *value)
                continue
            equal, finite, steps = value
            assert equal and finite and steps == 12, key


def _overflow(rank, world, hook):
    import ciuicflow

    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = ciuicflow.register(ddp, hook, warmup_steps=1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        _step(ddp, optimizer, rank, step)
    before = copy.deepcopy(state.state_dict()["memory"])
    x, y = _batch(rank, 99)
    if rank == 1:
        x[0, 0] = float("inf")  # an overflow on one rank only, as under AMP
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    grads_finite = [bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.numel()]
    after = state.state_dict()["memory"]
    untouched = sorted(before) == sorted(after) and all(
        all(torch.equal(before[k]["tensors"][n], after[k]["tensors"][n])
            for n in before[k]["tensors"])
        for k in before)
    return {"some_grad_nonfinite": not all(grads_finite), "untouched": untouched,
            "fallbacks": state.stats()["nonfinite_fallbacks"], "buckets_per_step": len(before)}


OVERFLOW_HOOKS = ["hierarchical_1bit", "hierarchical_powersgd", "onebit", "powersgd"]


def _overflows(rank, world):
    return {hook: _overflow(rank, world, hook) for hook in OVERFLOW_HOOKS}


def test_overflow_bucket_is_reduced_exactly_and_memory_untouched():
    for results in run_distributed(_overflows, 4, nodes=2):
        for hook, r in results.items():
            assert r["some_grad_nonfinite"], (hook, "every rank must see the overflow")
            assert r["untouched"], hook
            assert r["fallbacks"] >= 1 and r["buckets_per_step"] > 1, hook


def _exclusions(rank, world):
    import ciuicflow

    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    ciuicflow.register(ddp, "hierarchical_1bit", warmup_steps=0, exclude=["*.bias", "norm.*"])
    x, y = _batch(rank, 5)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    local = Net()
    torch.nn.functional.cross_entropy(local(x), y).backward()
    gaps = {}
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        if not p.numel():
            continue
        exact = q.grad.clone()
        dist.all_reduce(exact)
        exact /= world
        gaps[name] = (p.grad - exact).abs().max().item()
    return gaps


def test_excluded_parameters_are_reduced_exactly():
    for gaps in run_distributed(_exclusions, 4, nodes=2):
        for name, gap in gaps.items():
            if name.endswith(".bias") or name.startswith("norm."):
                assert gap < 1e-6, (name, gap)
            else:
                assert gap > 1e-4, (name, gap)  # the weights really were compressed


def _after_a_failed_bucket(rank, world):
    import ciuicflow

    out = {}
    for overlap in (True, False):
        ddp = DDP(Net(), bucket_cap_mb=0.0001)
        state = ciuicflow.register(ddp, "hierarchical_1bit", warmup_steps=0, overlap=overlap)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        reduce_bucket, calls = state._reduce_bucket, []

        def failing_once(info, step, route, reduce_bucket=reduce_bucket, calls=calls):
            calls.append((step, info.index))
            if step == 2 and sum(1 for s, _ in calls if s == 2) == 2:
                # the second bucket of step 2 (DDP rebuilds its buckets after step 0), before
                # any of its collectives
                raise RuntimeError("injected fault")
            return reduce_bucket(info, step, route)

        state._reduce_bucket = failing_once
        errors = []
        for step in range(3):
            try:
                _step(ddp, optimizer, rank, step)
                errors.append(None)
            except RuntimeError as exc:
                errors.append(str(exc))
        out[overlap] = {"errors": errors, "calls": calls,
                        "buckets_per_step": sum(1 for s, _ in calls if s == 1)}
    return out


def test_a_failed_bucket_stops_the_state_from_issuing_more_collectives():
    for results in run_distributed(_after_a_failed_bucket, 4, nodes=2):
        for overlap, r in results.items():
            assert r["errors"][:2] == [None, None], overlap
            assert "injected fault" in r["errors"][2], (overlap, r["errors"])
            # no bucket of the state is reduced after the failure (the buckets already queued behind
            # it included): this rank's collectives would no longer be in its peers' order
            first_of_step2 = next(i for i, (s, _) in enumerate(r["calls"]) if s == 2)
            assert len(r["calls"]) == first_of_step2 + 2, (overlap, r["calls"])
            assert r["buckets_per_step"] > 2, overlap


# -- world sizes and node layouts --------------------------------------------------------------


def _small_worlds(rank, world):
    out = {}
    for hook in HOOKS:
        options = {} if hook == "hierarchical_allreduce" else {"warmup_steps": 1}
        if "powersgd" in hook:
            options["rank"] = 2  # the default (16) leaves this small model's matrices exact
        model, state = _train(hook, steps=12, **options)
        exact, _ = _train(None, steps=12)
        stats = state.stats()
        gap, cosine = _gap_and_direction(_flat_params(model), _flat_params(exact), Net())
        out[hook] = {"gap": (_flat_params(model) - _flat_params(exact)).abs().max().item(),
                     "relative_gap": gap, "cosine": cosine,
                     "equal": _replicas_equal(_flat_params(model)),
                     "inter": stats["inter_node_bytes"], "exact_inter": stats["exact_inter_node_bytes"],
                     "steps": stats["steps"]}
    return out


def test_world_size_one():
    for hook, r in run_distributed(_small_worlds, 1, nodes=1)[0].items():
        assert r["gap"] == 0 and r["inter"] == 0 and r["steps"] == 12, hook


def test_single_node_hierarchical_hooks_are_exact():
    results = run_distributed(_small_worlds, 2, nodes=1)
    for hook, r in results[0].items():
        assert r["inter"] == 0, hook  # nothing leaves the node
        if hook.startswith("hierarchical"):
            assert r["gap"] < 1e-6, (hook, r["gap"])


def test_uneven_nodes_fall_back_to_flat_hooks():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_distributed(_small_worlds, 3, node_sizes=[2, 1])
    assert results[0]["hierarchical_allreduce"]["gap"] < 1e-6
    assert all(r["steps"] == 12 for r in results[0].values())
    for hook, r in results[0].items():  # the compressed hooks run flat, compressed and in step
        assert all(rank[hook]["equal"] for rank in results), hook
        if hook != "hierarchical_allreduce":
            assert r["inter"] < r["exact_inter"], hook
            # measured: 1-bit gap 0.36, cosine 0.84; PowerSGD 0.17, 0.95; zeros 0.54, 0.55
            _check_gap(hook, r["relative_gap"], r["cosine"])


# -- state objects ------------------------------------------------------------------------------


def test_states_validate_their_arguments():
    import ciuicflow

    with pytest.raises(ValueError, match="multiple of 8"):
        ciuicflow.OneBitState(chunk_size=100)
    with pytest.raises(ValueError, match="rank"):
        ciuicflow.PowerSGDState(rank=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        ciuicflow.OneBitState(warmup_steps=-1)
    with pytest.raises(TypeError, match="OneBitState"):
        ciuicflow.hierarchical_1bit(ciuicflow.PowerSGDState(), None)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ciuicflow.register(torch.nn.Linear(2, 2), "onebit")
    one = ciuicflow.OneBitState(chunk_size=64)
    with pytest.raises(ValueError, match="chunk_size"):
        one.load_state_dict(ciuicflow.OneBitState(chunk_size=128).state_dict())
    with pytest.raises(ValueError, match="powersgd"):
        one.load_state_dict(ciuicflow.PowerSGDState().state_dict())
    # pickling keeps the configuration, leaves the process group behind
    state = ciuicflow.PowerSGDState(rank=3, warmup_steps=7, exclude=["*.bias"], seed=5)
    clone = pickle.loads(pickle.dumps(state))
    assert (clone.rank, clone.warmup_steps, clone.exclude, clone.seed) == (3, 7, ("*.bias",), 5)
    assert clone.process_group is None and clone.topology is None


def _unknown_hook(rank, world):
    import ciuicflow

    with pytest.raises(ValueError, match="unknown hook"):
        ciuicflow.register(DDP(Net()), "threebit")
    with pytest.raises(ValueError, match="'hierarchical_1bit' always takes the hierarchical"):
        ciuicflow.register(DDP(Net()), "hierarchical_1bit", route="flat")
    assert ciuicflow.register(DDP(Net()), "onebit", route="flat").compressor.route == "flat"
    x, y = _batch(rank, 0)
    # a state built by hand: the hook refuses the route it cannot take, rather than ignore it
    ddp = DDP(Net())
    ddp.register_comm_hook(ciuicflow.OneBitState(route="flat"), ciuicflow.hierarchical_1bit)
    with pytest.raises(ValueError, match="always takes the hierarchical route"):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    ddp = DDP(Net())  # int8's route is "flat" by default: nothing was asked
    ddp.register_comm_hook(ciuicflow.Int8State(), ciuicflow.hierarchical_int8)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    ddp = DDP(Net())
    state = ciuicflow.OneBitState(warmup_steps=0, exclude=["*.bias"])
    ddp.register_comm_hook(state, ciuicflow.hierarchical_1bit)
    with pytest.raises(RuntimeError, match="parameter names"):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    return True


def test_register_errors_are_clear():
    assert run_distributed(_unknown_hook, 2, nodes=1) == [True, True]


# -- the accuracy guard -------------------------------------------------------------------------


def _guard(rank, world):
    import warnings

    out = {}
    for hook in ("hierarchical_1bit", "onebit", "hierarchical_powersgd", "powersgd"):
        for guard in ("warn", "exact", "fp16"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                extra = {"rank": 2} if "powersgd" in hook else {}
                model, state = _train(hook, warmup_steps=2, guard=guard, guard_threshold=1e-3,
                                      **extra)
            out[(hook, guard)] = {
                "stats": state.stats(), "replicas_equal": _replicas_equal(_flat_params(model)),
                "warned": any("error-feedback memory is" in str(w.message) for w in caught)}
        _, quiet = _train(hook, warmup_steps=2, guard="off")
        out[(hook, "off")] = {"stats": quiet.stats()}
    return out


def test_accuracy_guard_measures_warns_and_falls_back():
    """Every compressing hook reports ||memory|| / ||gradient|| per bucket; above the threshold it
    warns, and with guard='exact' the next step of that bucket is exact (fewer bytes saved), with
    guard='fp16' that step is sent in float16 (fewer bytes than exact's, more than none)."""
    results = run_distributed(_guard, 4, nodes=2, timeout=240)
    for (hook, guard), r in results[0].items():
        stats = r["stats"]
        if guard == "off":
            assert stats["relative_error"] is None and stats["guard_alerts"] == 0, hook
            continue
        assert stats["relative_error"] > 1e-3 and stats["relative_errors"], (hook, guard)
        assert stats["guard_alerts"] > 0 and r["warned"], (hook, guard)
        assert all(rank[(hook, guard)]["replicas_equal"] for rank in results), (hook, guard)
        if guard == "exact":
            assert stats["guard_exact_steps"] > 0, hook
            warn = results[0][(hook, "warn")]["stats"]
            assert stats["inter_node_bytes"] > warn["inter_node_bytes"], hook
        elif guard == "fp16":
            exact = results[0][(hook, "exact")]["stats"]
            warn = results[0][(hook, "warn")]["stats"]
            assert stats["guard_exact_steps"] == exact["guard_exact_steps"] > 0, hook
            assert warn["inter_node_bytes"] < stats["inter_node_bytes"] \
                < exact["inter_node_bytes"], hook
        else:
            assert stats["guard_exact_steps"] == 0, hook
