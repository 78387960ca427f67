"""Tensors that an adaptive optimizer steps go with the int4 codec (or int8) under the 1-bit hooks
(``compression.optimizer_watch``; docs/hooks.md, "Adaptive optimizers"), on real gloo processes."""
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ciuicflow.compression import optimizer_watch
from tests.dist_utils import run_distributed
from tests.test_hooks import Net, _batch, _flat_params, _replicas_equal


@pytest.mark.parametrize("make, adaptive", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), False),
    (lambda p: torch.optim.SGD(p, lr=0.1), False),
    (lambda p: torch.optim.Adam(p), True),
    (lambda p: torch.optim.AdamW(p), True),
    (lambda p: torch.optim.RMSprop(p), True),
    (lambda p: torch.optim.Adagrad(p), True),
])
def test_watch_tells_adaptive_optimizers_from_linear_ones(make, adaptive):
    optimizer_watch.watch()
    stepped, idle = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    optimizer = make([stepped])
    assert not optimizer_watch.stepped_adaptively([stepped])  # nothing learnt before a step
    stepped.grad = torch.ones(4)
    optimizer.step()
    assert optimizer_watch.stepped_adaptively([stepped]) is adaptive
    assert optimizer_watch.stepped_adaptively([idle, stepped]) is adaptive
    assert not optimizer_watch.stepped_adaptively([idle])
    # a parameter added later is learnt at the next step
    late = torch.nn.Parameter(torch.ones(2))
    optimizer.add_param_group({"params": [late]})
    late.grad = torch.ones(2)
    optimizer.step()
    assert optimizer_watch.stepped_adaptively([late]) is adaptive
    # freed parameters leave the record (their ids may be reused)
    key = id(stepped)
    del optimizer, stepped, late
    gc.collect()
    assert key not in optimizer_watch._adaptive


def test_a_wrapper_is_judged_by_the_optimizer_it_builds():
    """ZeroRedundancyOptimizer(params, optimizer_class=SGD) steps linearly; with Adam, not."""
    class Wrapper:  # what the watch reads of ZeroRedundancyOptimizer
        def __init__(self, cls):
            self._optim_constructor = cls

    assert not optimizer_watch.is_adaptive(Wrapper(torch.optim.SGD))
    assert optimizer_watch.is_adaptive(Wrapper(torch.optim.Adam))


def test_the_first_reduction_with_the_adaptive_codec_says_so_once(caplog):
    """Why a 1-bit state's ratio is int4's under Adam: one INFO line per compressor, naming the
    codec and its ratio; nothing for tensors SGD steps or for the "same" policy."""
    import logging

    from ciuicflow.compression.onebit import OneBitCompressor

    with caplog.at_level(logging.INFO, logger="ciuicflow.compression"):
        default, twobit, same = (OneBitCompressor(), OneBitCompressor(adaptive_optimizer="twobit"),
                                 OneBitCompressor(adaptive_optimizer="same"))
        small = OneBitCompressor(adaptive_optimizer="twobit", chunk_size=64)
        default._pick(False, None)
        assert not caplog.records
        for compressor in (default, twobit, same, small):
            for _ in range(3):
                compressor._pick(True, None)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "go as int4" in messages[0] and "7.8x" in messages[0]
    assert "go as twobit" in messages[1] and "14.8x" in messages[1]
    assert "12.2x" in messages[2]  # 64-element chunks: 2 bits and 5 bytes per 64 elements


POLICIES = ("default", "int4", "int8", "twobit", "same")  # "default": adaptive_optimizer not given


def _bytes_and_codecs(run):
    stats = run["stats"]
    return stats["inter_node_bytes"], stats["compression_ratio"], stats["adaptive_codec_reductions"]


def _train(hook, optimizer, steps=12, **options):
    import ciuicflow

    model = Net()
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = ciuicflow.register(ddp, hook, warmup_steps=2, **options) if hook else None
    opt = (torch.optim.AdamW(ddp.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
    for step in range(steps):
        x, y = _batch(dist.get_rank(), step)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _flat_params(model), state


def _runs(rank, world):
    out = {}
    start = _flat_params(Net())
    for optimizer in ("adamw", "sgd"):
        exact, _ = _train(None, optimizer)
        for hook in ("hierarchical_1bit", "onebit"):
            for policy in POLICIES:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    options = {} if policy == "default" else {"adaptive_optimizer": policy}
                    params, state = _train(hook, optimizer, **options)
                out[(optimizer, hook, policy)] = {
                    "stats": state.stats(),
                    "replicas_equal": _replicas_equal(params),
                    "gap": (params - exact).norm().item() / (exact - start).norm().item(),
                    "warned": any("adaptive optimizer" in str(w.message) for w in caught)}
    return out


def test_adaptive_optimizer_tensors_go_as_int4_by_default():
    """AdamW's tensors go as int4 by default, or int8 if asked (about 4x / 8x the 1-bit bytes; far
    closer to exact AdamW training than 1-bit, which ``adaptive_optimizer="same"`` keeps); SGD's
    stay 1-bit."""
    results = run_distributed(_runs, 4, nodes=2, timeout=300)
    for key, r in results[0].items():
        assert all(rank[key]["replicas_equal"] for rank in results), key
    for hook in ("hierarchical_1bit", "onebit"):
        by = {policy: results[0][("adamw", hook, policy)] for policy in POLICIES}
        same = by["same"]
        assert _bytes_and_codecs(by["default"]) == _bytes_and_codecs(by["int4"]), hook  # the default: int4
        assert by["default"]["gap"] == by["int4"]["gap"], hook
        # int4 sends about 4x the payload of 1-bit's signs (4 bits per element against 1, plus
        # scales), int8 about 8x; DDP's 1-bit also sends 4 values per 256-element chunk of a
        # concentrated window (at most 1.5 bits per element: factors down to 2.7x and 5x).
        # Measured: values only where concentrated (now) int8 0.21 hierarchical; every chunk
        # reserving them (before) int4 0.49 hierarchical, 0.57 flat (int8 0.31 flat); with the
        # values left out 0.35 / 0.19 and 0.36 / 0.20.
        # twobit (2 bits and a byte per chunk) about 2x: measured 0.70 hierarchical, 0.71 flat.
        bounds = (("int4", (0.3, 0.7)), ("int8", (0.15, 0.4)), ("twobit", (0.55, 0.85)))
        for policy, payload_ratio in bounds:
            adam = by[policy]
            # the buckets of the 10 compressed steps went with that codec (several per step), said once
            assert adam["stats"]["adaptive_codec_reductions"] > 2 * 10, (hook, policy)
            assert adam["warned"] and not same["warned"], (hook, policy)
            ratio = adam["stats"]["compression_ratio"] / same["stats"]["compression_ratio"]
            assert payload_ratio[0] < ratio < payload_ratio[1], (hook, policy, ratio)
            # and stays closer to exact training (measured: int8 0.024 of exact training's movement
            # away from it, int4 0.17-0.22, against 0.40-0.50 for 1-bit; the suite's runs decide
            # accuracy: docs/convergence.md; twobit 0.27-0.35, 0.68-0.70 of 1-bit's)
            closer = 0.8 if policy == "twobit" else 0.6
            assert adam["gap"] < closer * same["gap"], (hook, policy, adam["gap"], same["gap"])
        # more bits, closer
        assert by["int8"]["gap"] < by["int4"]["gap"] < by["twobit"]["gap"] < same["gap"], hook
        assert same["stats"]["adaptive_codec_reductions"] == 0, hook
        # SGD: the policy changes nothing
        sgd = [results[0][("sgd", hook, policy)] for policy in POLICIES]
        assert not any(r["warned"] for r in sgd), hook
        assert all(r["stats"]["adaptive_codec_reductions"] == 0 for r in sgd), hook
        assert len({r["gap"] for r in sgd}) == 1, hook
        assert len({r["stats"]["inter_node_bytes"] for r in sgd}) == 1, hook


def _fsdp_defaults(rank, world):
    """The default 1-bit states of both FSDP paths under AdamW (the FSDP tests' model)."""
    from tests import test_fsdp, test_fsdp_scatter

    out = {}
    for name, module, mesh in (("hierarchical_1bit", test_fsdp, test_fsdp._mesh()),
                               ("onebit", test_fsdp_scatter, test_fsdp_scatter._mesh())):
        for policy in POLICIES[1:]:  # (the FSDP tests' _build defaults to "same")
            model, optimizer, state = module._build(name, mesh, warmup_steps=2,
                                                    adaptive_optimizer=policy)
            for step in range(6):
                module._step(model, optimizer, step)
            out[(name, policy)] = state.stats()
    return out


def test_fsdp_paths_send_adaptive_optimizer_tensors_as_int4_by_default():
    stats = run_distributed(_fsdp_defaults, 4, nodes=2, timeout=300)[0]
    for name in ("hierarchical_1bit", "onebit"):
        int4, int8, twobit, same = (stats[(name, p)] for p in POLICIES[1:])
        assert min(c["adaptive_codec_reductions"] for c in (int4, int8, twobit)) >= 4 * 3
        assert same["adaptive_codec_reductions"] == 0
        # int8: about 1/3.9 of the float32 bytes; int4 about 1/7.5; twobit about 1/14.8 (measured
        # 14.4 and 14.2 here); 1 bit: over 20x (measured 27 and 26 here)
        assert 3 < int8["compression_ratio"] < 4.5 < 6 < int4["compression_ratio"] < 8.5 < 20 \
            < same["compression_ratio"], (name, stats)
        assert 12 < twobit["compression_ratio"] < 17, (name, twobit)
