"""compression.policy: one function says what a tensor carries (``ciuicflow.explain``), and what the
states report sending (``stats()["wire"]``) is what it said, on real gloo processes."""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ciuicflow
from tests.dist_utils import run_distributed
from tests.test_hooks import Net, _batch


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
    # a flat state's route="auto" takes the node sum on whole nodes of several ranks
    ("onebit", (2, 2), "cpu", "sgd", {}, ("onebit", 1, "", "hierarchical", 2, 4)),
    ("onebit", (2, 2), "cpu", "sgd", {"route": "flat"}, ("onebit", 1, "", "flat", 4, 4)),
    ("onebit", (4, 1), "cpu", "sgd", {}, ("onebit", 1, "", "flat", 4, 4)),
    # an adaptive optimizer's tensors: topmark quantised once from CPU tensors, int4 elsewhere
    ("hierarchical_1bit", (2, 2), "cpu", "adam", {}, ("topmark", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_1bit", (3, 2), "cpu", "adamw", {}, ("topmark", 1, "", "hierarchical", 3, 0)),
    ("hierarchical_1bit", (4, 2), "cpu", "adam", {}, ("int4", 2, "int4", "hierarchical", 4, 0)),
    ("hierarchical_1bit", (2, 2), "cuda", "adam", {}, ("int4", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_1bit", (2, 2), "cpu", "adam", {"adaptive_optimizer": "int8"},
     ("int8", 1, "", "hierarchical", 2, 0)),
    ("hierarchical_1bit", (2, 2), "cpu", "adam", {"adaptive_optimizer": "same"},
     ("onebit", 1, "", "hierarchical", 2, 4)),
    # int4 and int8 keep their codec under any optimizer; two phases beyond two ranks
    ("hierarchical_int4", (2, 2), "cpu", "adam", {}, ("int4", 1, "", "hierarchical", 2, 0)),
    ("int8", (4, 1), "cpu", "sgd", {}, ("int8", 2, "int8", "flat", 4, 0)),
])
def test_explain_states_the_rule(method, shape, device, optimizer, options, expected):
    plan = ciuicflow.explain(method, nodes=shape[0], ranks_per_node=shape[1], device=device,
                             optimizer=optimizer, **options)
    assert _key(plan) == expected
    assert plan.reasons and plan.describe().startswith(method)
    assert plan.sends_target == (plan.codec == plan.family and plan.server_codec in ("", plan.family))


def test_explain_refuses_an_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        ciuicflow.explain("hierarchical_2bit", nodes=2)


def _train(hook, optimizer, steps=6, **options):
    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = ciuicflow.register(ddp, hook, warmup_steps=2, **options)
    opt = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    for step in range(steps):
        x, y = _batch(dist.get_rank(), step)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return state.stats()


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
