"""compression.policy: one function says what a tensor carries (``ciuicflow.explain``), and what the
states report sending (``stats()["wire"]``) is what it said, on real gloo processes."""
import warnings

import pytest

import ciuicflow
from tests.dist_utils import run_distributed
from tests.compression.training import _train as train


def _key(plan):
    return plan.codec, plan.phases, plan.server_codec, plan.route, plan.exchange_ranks, plan.values


@pytest.mark.parametrize("method, shape, device, optimizer, options, expected", [
    # SGD: 1 bit and its values, one phase up to four exchanging ranks, then int4 servers
    ("hierarchical_1bit", (2, 2), "cpu", "sgd", {}, ("onebit", 1, "", "hierarchical", 2, 4)),
    ("hierarchical_1bit", (4, 1), "cpu", "sgd", {}, ("onebit", 1, "", "hierarchical", 4, 4)),
    ("hierarchical_1bit", (8, 2), "cuda", "sgd", {}, ("onebit", 2, "int4", "hierarchical", 8, 4)),
    ("hierarchical_1bit", (8, 2), "cpu", "sgd", {"server_codec": "same"},
     ("onebit", 2, "onebit", "hierarchical", 8, 4)),
    ("hierarchical_1bit", (3, 2), "cpu", "sgd", {"phases": 2},
     ("onebit", 2, "onebit", "hierarchical", 3, 4)),
    # a flat hook is flat; route="auto" opts in to the node sum on whole nodes of several ranks
    ("onebit", (2, 2), "cpu", "sgd", {}, ("onebit", 1, "", "flat", 4, 4)),
    ("onebit", (2, 2), "cpu", "sgd", {"route": "auto"}, ("onebit", 1, "", "hierarchical", 2, 4)),
    ("onebit", (4, 1), "cpu", "sgd", {}, ("onebit", 1, "", "flat", 4, 4)),
    # an adaptive optimizer's tensors start on the ladder's first rung, int4, on any device
    ("hierarchical_1bit", (2, 2), "cpu", "adam", {}, ("int4", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_1bit", (3, 2), "cpu", "adamw", {}, ("int4", 2, "int4", "hierarchical", 3, 0)),
    ("hierarchical_1bit", (4, 2), "cpu", "adam", {}, ("int4", 2, "int4", "hierarchical", 4, 0)),
    ("hierarchical_1bit", (2, 2), "cuda", "adam", {}, ("int4", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_1bit", (2, 2), "cpu", "adam", {"adaptive_optimizer": "int8"},
     ("int8", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_1bit", (2, 2), "cpu", "adam", {"adaptive_optimizer": "same"},
     ("onebit", 1, "", "hierarchical", 2, 4)),
    # int4 starts on its own rung; int8 is the ladder's top; two phases beyond two ranks
    ("hierarchical_int4", (2, 2), "cpu", "adam", {}, ("int4", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_int8", (2, 2), "cpu", "adam", {}, ("int8", 1, "", "hierarchical", 2, 0)),
    ("int8", (4, 1), "cpu", "sgd", {}, ("int8", 2, "int8", "flat", 4, 0)),
])
def test_explain_states_the_rule(method, shape, device, optimizer, options, expected):
    plan = ciuicflow.explain(method, nodes=shape[0], ranks_per_node=shape[1], device=device,
                             optimizer=optimizer, **options)
    assert _key(plan) == expected
    assert plan.reasons and plan.describe().startswith(method)
    assert plan.sends_target == (plan.codec == plan.family and plan.server_codec in ("", plan.family))


def test_the_ladder_climbs_after_patience_and_never_down():
    """An adaptive optimizer's tensor: one rung up after PATIENCE steps in a row above the
    tolerance, none where a step falls back under it, none past the top, never down."""
    from ciuicflow.compression import policy

    plan = policy.explain("hierarchical_1bit", nodes=2, optimizer="adam")
    assert (plan.codec, plan.rungs_left) == ("int4", 1)
    rung, over = 0, 0
    high, low = 2 * policy.TOLERANCE, policy.TOLERANCE / 2
    for noise in [high] * (policy.PATIENCE - 1) + [low] + [high] * (policy.PATIENCE - 1):
        rung, over = policy.climb(plan, rung, over, noise)
    assert rung == 0  # the low step restarted the count
    rung, over = policy.climb(plan, rung, over, high)
    assert rung == 1
    top = policy.wire_plan("hierarchical_1bit", exchange_ranks=2, adaptive=True, rung=rung)
    assert (top.codec, top.rungs_left) == ("int8", 0)
    for _ in range(3 * policy.PATIENCE):
        rung, over = policy.climb(top, rung, over, high)
    assert rung == 1
    for _ in range(3 * policy.PATIENCE):
        rung, over = policy.climb(top, rung, over, 0.0)
    assert rung == 1
    sgd = policy.explain("hierarchical_1bit", nodes=2)
    assert policy.climb(sgd, 0, 0, 100.0) == (0, 0)  # no ladder: the guard's business


def test_only_an_adaptive_optimizers_all_reduced_tensors_are_quantised_in_its_units():
    """The plan says where the compressors divide by the optimizer's units: an adaptive
    optimizer's tensors on the all-reduce routes (every rung, a pinned codec too); not under SGD,
    not with ``adaptive_optimizer="same"`` (1 bit as under SGD), not on FSDP's reduce-scatter
    (a rank holds the units of its own shard only)."""
    from ciuicflow.compression import policy

    assert policy.explain("hierarchical_1bit", nodes=2, optimizer="adam").in_units
    assert policy.wire_plan("hierarchical_1bit", exchange_ranks=2, adaptive=True, rung=1).in_units
    assert policy.explain("hierarchical_int8", nodes=4, ranks_per_node=2, optimizer="adamw").in_units
    assert policy.explain("int4", nodes=2, ranks_per_node=2, optimizer="adam").in_units
    assert not policy.explain("hierarchical_1bit", nodes=2).in_units
    assert not policy.explain("hierarchical_int4", nodes=2).in_units
    assert not policy.explain("hierarchical_1bit", nodes=2, optimizer="adam",
                              adaptive_optimizer="same").in_units
    scatter = policy.wire_plan("onebit", exchange_ranks=4, route="reduce_scatter", adaptive=True)
    assert scatter.codec == "int4" and not scatter.in_units
    assert "plain units" in scatter.reasons[0]
    assert policy.explain("hierarchical_1bit", nodes=2, optimizer="adam").as_dict()["in_units"]


def test_explain_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        ciuicflow.explain("hierarchical_2bit", nodes=2)


def _train(hook, optimizer, steps=6, **options):
    return train(hook, optimizer, steps, **options)[1].stats()


CASES = (("hierarchical_1bit", "sgd", {}), ("hierarchical_1bit", "adamw", {}),
         ("onebit", "sgd", {}), ("onebit", "sgd", {"route": "flat"}),
         ("hierarchical_1bit", "adamw", {"adaptive_optimizer": "int8"}),
         ("hierarchical_int4", "adamw", {}))


def _runs(rank, world):
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (hook, optimizer, options) in enumerate(CASES):
            out[i] = _train(hook, optimizer, **options)
    return out


def test_stats_report_what_explain_says():
    """Every bucket of every case sent what ``explain`` states for its shape, device and optimizer,
    on every rank; a 1-bit method's steps sent beyond 1 bit are counted (AdamW's buckets), and
    none where it sends only 1 bit."""
    results = run_distributed(_runs, 4, nodes=2, timeout=300)
    for i, (hook, optimizer, options) in enumerate(CASES):
        plan = ciuicflow.explain(hook, nodes=2, ranks_per_node=2, device="cpu",
                                 optimizer=optimizer, **options)
        for rank, result in enumerate(results):
            stats = result[i]
            assert stats["wire"], (hook, optimizer, options)
            for key, sent in stats["wire"].items():
                got = (sent["codec"], sent["phases"], sent["server_codec"], sent["route"],
                       sent["exchange_ranks"], sent["values"])
                assert got == _key(plan), (hook, optimizer, options, rank, key)
                assert sent["changes"] == 0, (hook, optimizer, options, rank, key)
            beyond = stats["beyond_target_reductions"]
            # 4 compressed steps past the 2 warm-up steps, each of several buckets
            assert (beyond > 4) if not plan.sends_target else (beyond == 0), (hook, optimizer, beyond)


def _ladder_runs(rank, world):
    from ciuicflow.compression import policy

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tolerance in (0.0, float("inf")):
            policy.TOLERANCE = tolerance  # the rule's constant, set for this process's run
            stats = _train("hierarchical_1bit", "adamw", steps=2 + policy.PATIENCE + 2)
            out[tolerance] = {key: (w["codec"], w["changes"]) for key, w in stats["wire"].items()}
    return out


def test_a_bucket_climbs_its_ladder_on_every_rank_of_its_exchange_alike():
    """With no tolerance every AdamW bucket is raised from int4 to int8 after PATIENCE compressed
    steps, once, on every rank alike; with an infinite one none is."""
    results = run_distributed(_ladder_runs, 4, nodes=2, timeout=300)
    for rank, result in enumerate(results):
        assert result[0.0] and set(result[0.0].values()) == {("int8", 1)}, (rank, result[0.0])
        assert set(result[float("inf")].values()) == {("int4", 0)}, (rank, result)


def test_plan_explain_prints_the_plans_the_compressors_take(tmp_path, capsys):
    """``ciuicflow plan --explain``: each quantising DDP method's plan, as ``explain`` states it for
    the cluster's shape and the workload's optimizer, printed and in the JSON."""
    import argparse
    import json

    from ciuicflow import plan as pl

    parser = argparse.ArgumentParser()
    pl.add_arguments(parser)
    out = tmp_path / "plan.json"
    args = ["--model", "1B", "--nodes", "8", "--gpus-per-node", "4", "--optimizer", "adam",
            "--explain", "--json", str(out)]
    assert pl.run(parser.parse_args(args)) == 0
    printed = capsys.readouterr().out
    plans = {p["method"]: p for p in json.loads(out.read_text())["wire_plans"]}
    assert set(plans) == {"hierarchical_1bit", "onebit", "hierarchical_int8", "int8",
                          "hierarchical_int4", "int4"}
    for method, got in plans.items():
        want = ciuicflow.explain(method, nodes=8, ranks_per_node=4, optimizer="adam")
        assert got == want.as_dict(), method
        assert want.describe().splitlines()[0] in printed, method
    assert plans["hierarchical_1bit"]["codec"] == "int4" and plans["hierarchical_1bit"]["rungs_left"] == 1


def _fsdp_ladder_runs(rank, world):
    from ciuicflow.compression import policy
    from tests.fsdp import helpers as test_fsdp

    out = {}
    mesh = test_fsdp._mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tolerance in (0.0, float("inf")):
            policy.TOLERANCE = tolerance  # the rule's constant, set for this process's run
            model, optimizer, state = test_fsdp._build("hierarchical_1bit", mesh, warmup_steps=2,
                                                       adaptive_optimizer="auto")
            for step in range(2 + policy.PATIENCE + 2):
                test_fsdp._step(model, optimizer, step)
            out[tolerance] = {key: (w["codec"], w["changes"])
                              for key, w in state.stats()["wire"].items()}
    return out


def test_an_hsdp_group_climbs_its_ladder_as_a_ddp_bucket_does():
    """HSDP's replicas (``ciuicflow.fsdp``, hierarchical_1bit under AdamW) measure each parameter
    group's noise in the optimizer's units on its local shard: with no tolerance every group is
    raised from int4 to int8 after PATIENCE compressed steps, once, on every rank; with an
    infinite one none is."""
    results = run_distributed(_fsdp_ladder_runs, 4, nodes=2, timeout=300)
    for rank, result in enumerate(results):
        assert result[0.0] and set(result[0.0].values()) == {("int8", 1)}, (rank, result[0.0])
        assert set(result[float("inf")].values()) == {("int4", 0)}, (rank, result)
