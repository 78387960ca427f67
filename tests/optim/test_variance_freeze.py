"""When OneBitAdam and ZeroOneAdam freeze their variance (ciuicflow.optim.variance_freeze), on real
gloo processes: 4 ranks as 2 simulated nodes x 2.

The gradients are made up per rank and step (one 512-element parameter): noise around a constant,
so the variance settles, and more noise on some ranks than on others, so that the ranks' own
measures settle on different steps. ``caller_averages_grads=True`` makes each rank keep its own
variance (the optimizer trusts the caller to have averaged): only the reduction of the measure
across ranks can make them decide alike.
"""
import io
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

WORLD, NODES = 4, 2
NOISE = (0.2, 0.6, 0.3, 0.4)  # per rank: the noisier, the later the variance settles
BETAS, EPS = (0.9, 0.999), 1e-8


def _gradient(rank, step, numel=512):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return 1 + NOISE[rank] * torch.randn(numel, generator=g)


def _optimizer(kind, param, **options):
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam

    cls = OneBitAdam if kind == "onebit" else ZeroOneAdam
    extra = {} if kind == "onebit" else {"warmup_steps": 10_000}  # every step a variance step
    return cls([param], lr=1e-3, betas=BETAS, eps=EPS, caller_averages_grads=True, **extra,
               **options)


def _train(optimizer, param, rank, steps, variances=None):
    """Until the variance freezes on some rank: every rank stops there, so that a rank that froze
    alone cannot wait for the others in a collective."""
    for step in steps:
        anyone_frozen = torch.tensor([float(optimizer.frozen)])
        dist.all_reduce(anyone_frozen, op=dist.ReduceOp.MAX)
        if anyone_frozen.item():
            break
        param.grad = _gradient(rank, step)
        optimizer.step()
        if variances is not None:
            variances.append(optimizer.state[param]["exp_avg_sq"].clone())


def _window_rates(variances, window=20, floor=40):
    """The freeze measure written out: the mean over elements of min(|d_t - d_s| / d_s, 1) / (t - s),
    d = sqrt(v / (1 - b2^t)) + eps, over windows ending at floor, floor + window, ..."""
    def preconditioner(t):
        return (variances[t - 1] / (1 - BETAS[1] ** t)).sqrt() + EPS

    return {end: float(((preconditioner(end) - preconditioner(end - window)).abs()
                        / preconditioner(end - window)).clamp(max=1).mean()) / window
            for end in range(floor, len(variances) + 1, window)}


def _first_stable(rates: dict):
    return next((end for end, rate in sorted(rates.items()) if rate <= 1 - BETAS[1]), None)


def _auto_freeze(rank, world, kind):
    param = torch.nn.Parameter(torch.zeros(512))
    optimizer = _optimizer(kind, param)
    variances = []
    _train(optimizer, param, rank, range(1, 401), variances)
    return {"frozen_at": optimizer.frozen_at, "rates": _window_rates(variances),
            "reason": optimizer.freeze_reason}


@pytest.mark.parametrize("kind", ["onebit", "zero_one"])
def test_auto_freeze_comes_on_the_same_step_on_every_rank_once_the_measure_is_stable(kind):
    results = run_distributed(_auto_freeze, WORLD, nodes=NODES, args=(kind,))
    # the first window in which every rank's measure is under the threshold
    ends = sorted(set.intersection(*(set(r["rates"]) for r in results)))
    expected = _first_stable({end: max(r["rates"][end] for r in results) for end in ends})
    own = [_first_stable(r["rates"]) for r in results]
    assert expected is not None and expected > 40, (expected, own)  # the measure decided, not the floor
    assert min(s for s in own if s) < expected  # ranks alone would have frozen apart
    for r in results:
        assert r["frozen_at"] == expected, ([r["frozen_at"] for r in results], expected, own)
        assert "variance frozen after step" in r["reason"] and "within" in r["reason"]


def _early_explicit_freeze(rank, world, kind, hold):
    param = torch.nn.Parameter(torch.zeros(512))
    argument = "freeze_steps" if kind == "onebit" else "var_freeze_step"
    optimizer = _optimizer(kind, param, **{argument: 60, "hold_until_stable": hold})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(optimizer, param, rank, range(1, 401))
    auto = _optimizer(kind, torch.nn.Parameter(torch.zeros(512)))
    _train(auto, auto.param_groups[0]["params"][0], rank, range(1, 401))
    return {"frozen_at": optimizer.frozen_at, "auto_frozen_at": auto.frozen_at,
            "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}


@pytest.mark.parametrize("kind", ["onebit", "zero_one"])
def test_an_early_explicit_freeze_is_held_with_a_warning_until_the_variance_is_stable(kind):
    for r in run_distributed(_early_explicit_freeze, WORLD, nodes=NODES, args=(kind, True)):
        assert r["auto_frozen_at"] > 60  # step 60 is too early on these gradients
        assert r["frozen_at"] == r["auto_frozen_at"], r  # held, then frozen where auto freezes
        held = [w for w in r["warnings"] if "is held" in w]
        assert len(held) == 1 and "=60" in held[0] and "hold_until_stable=False" in held[0], r


@pytest.mark.parametrize("kind", ["onebit", "zero_one"])
def test_an_early_explicit_freeze_without_hold_freezes_as_asked_with_a_warning(kind):
    for r in run_distributed(_early_explicit_freeze, WORLD, nodes=NODES, args=(kind, False)):
        assert r["frozen_at"] == 60, r
        assert any("as" in w and "=60 asks, although not judged stable" in w
                   for w in r["warnings"]), r


def _resume(rank, world, kind, save_at):
    """Straight on to step 200 against: to ``save_at``, save, a fresh optimizer loads, on."""
    def build():
        param = torch.nn.Parameter(torch.zeros(512))
        return param, _optimizer(kind, param)

    def run(param, optimizer, steps):
        for step in steps:
            param.grad = _gradient(rank, step)
            optimizer.step()

    param, optimizer = build()
    run(param, optimizer, range(1, 201))
    straight = (optimizer.frozen_at, param.detach().clone())

    param, optimizer = build()
    run(param, optimizer, range(1, save_at + 1))
    saved = io.BytesIO()
    torch.save({"param": param.detach(), "optimizer": optimizer.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=False)
    param, optimizer = build()
    with torch.no_grad():
        param.copy_(checkpoint["param"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    run(param, optimizer, range(save_at + 1, 201))
    return {"straight_frozen_at": straight[0], "resumed_frozen_at": optimizer.frozen_at,
            "same_params": torch.equal(param.detach(), straight[1])}


@pytest.mark.parametrize("kind", ["onebit", "zero_one"])
@pytest.mark.parametrize("save_at", [50, 150])  # mid-window before the freeze, and after it
def test_the_freeze_decision_survives_a_state_dict_round_trip(kind, save_at):
    for r in run_distributed(_resume, WORLD, nodes=NODES, args=(kind, save_at)):
        assert r["straight_frozen_at"] is not None and 50 < r["straight_frozen_at"] < 150, r
        assert r["resumed_frozen_at"] == r["straight_frozen_at"], r
        assert r["same_params"], r


def test_freeze_arguments_are_checked():
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam

    params = [torch.nn.Parameter(torch.zeros(4))]
    for bad in (0, -3, 2.5, "soon", True):
        with pytest.raises(ValueError, match="freeze_steps must be 'auto' or an integer"):
            OneBitAdam(params, freeze_steps=bad)
        with pytest.raises(ValueError, match="var_freeze_step must be 'auto' or an integer"):
            ZeroOneAdam(params, var_freeze_step=bad)
    assert OneBitAdam(params).freeze_steps == "auto" and ZeroOneAdam(params).var_freeze_step == "auto"
