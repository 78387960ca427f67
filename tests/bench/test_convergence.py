"""bench/convergence: the records it writes, how it judges them, and a smoke run end to end."""
import json
import subprocess
import sys

import pytest
import torch

from tests import REPO

ROOT = str(REPO)
from bench.convergence import report  # noqa: E402
from bench.convergence import tasks  # noqa: E402


def _record(task, method, value, metric="accuracy", nbytes=100.0):
    return {"task": task, "method": method, "metric": metric, "value": value, "curve": [(1, value)],
            "inter_node_bytes_per_step": nbytes}


def test_targets_judge_against_exact_and_torch_powersgd():
    records = report.compare([
        _record("a", "exact", 0.80, nbytes=1000), _record("a", "hierarchical_1bit", 0.795),
        _record("a", "onebit", 0.78), _record("a", "torch_powerSGD", 0.79, nbytes=50),
        _record("a", "powersgd", 0.785, nbytes=60),
        _record("b", "exact", 2.0, "val_loss"), _record("b", "hierarchical_1bit", 2.03, "val_loss"),
        _record("b", "onebit_adam", 2.05, "val_loss"),
        {"task": "b", "method": "powersgd", "failed": True, "error": "boom"}])
    by = {(r["task"], r["method"]): r for r in records}
    assert by[("a", "onebit")]["gap"] == pytest.approx(0.02)
    assert by[("b", "onebit_adam")]["relative_gap"] == pytest.approx(0.025)
    assert report.meets_target(by[("a", "hierarchical_1bit")]) is True
    assert report.meets_target(by[("a", "onebit")]) is False
    assert report.meets_target(by[("b", "hierarchical_1bit")]) is True
    assert report.meets_target(by[("b", "onebit_adam")]) is False
    missed = report.check_targets(records)
    assert any("a onebit" in m for m in missed) and any("b onebit_adam" in m for m in missed)
    # worse than PyTorch's PowerSGD while sending more bytes
    assert any("a powersgd: worse than torch" in m for m in missed)
    assert not any("hierarchical_1bit" in m for m in missed)
    text = report.table(records)
    assert "FAILED" in text and "MISSED" in text


def test_the_markdown_lists_what_missed(tmp_path):
    """The file says every miss, the comparisons with PyTorch's hook included (no table column)."""
    records = report.compare([
        _record("a", "exact", 0.80, nbytes=1000), _record("a", "powersgd", 0.785, nbytes=60),
        _record("a", "torch_powerSGD", 0.79, nbytes=50), _record("a", "hierarchical_1bit", 0.795)])
    report.write_outputs(records, str(tmp_path / "c.json"), str(tmp_path), png=False)
    text = (tmp_path / "convergence.md").read_text()
    assert "Targets missed:" in text and "a powersgd: worse than torch powerSGD_hook" in text
    met = report.compare([_record("a", "exact", 0.80), _record("a", "hierarchical_1bit", 0.795)])
    report.write_outputs(met, str(tmp_path / "d.json"), str(tmp_path), png=False)
    assert "Every target met." in (tmp_path / "convergence.md").read_text()


def _seeded(task, method, value, seed, nbytes=100.0):
    return dict(_record(task, method, value, nbytes=nbytes), seed=seed)


def test_seeds_judge_each_run_against_the_exact_run_of_its_seed():
    """--seeds: a run's gap is to the exact run of its own seed; the accuracy target is judged on
    the mean gap over the seeds, single seeds past it are notes; the means sit beside."""
    records = report.compare([
        _seeded("a", "exact", 0.80, 0, nbytes=1000), _seeded("a", "exact", 0.90, 1, nbytes=1000),
        _seeded("a", "onebit", 0.795, 0), _seeded("a", "onebit", 0.875, 1),
        _seeded("a", "hierarchical_1bit", 0.81, 0), _seeded("a", "hierarchical_1bit", 0.885, 1),
        _seeded("a", "torch_powerSGD", 0.79, 0, nbytes=50),
        _seeded("a", "torch_powerSGD", 0.95, 1, nbytes=50),
        _seeded("a", "powersgd", 0.785, 0, nbytes=60), _seeded("a", "powersgd", 0.96, 1, nbytes=60),
        _seeded("a", "int8", 0.80, 0, nbytes=60), _seeded("a", "int8", 0.90, 1, nbytes=60)])
    by = {(r["method"], r["seed"]): r for r in records}
    assert by[("onebit", 0)]["gap"] == pytest.approx(0.005)
    assert by[("onebit", 1)]["gap"] == pytest.approx(0.025)
    assert by[("onebit", 1)]["exact_value"] == 0.90
    missed = report.check_targets(records)
    # onebit: 1.5 points below exact by the mean, a miss; hierarchical_1bit: 0.25 by the mean,
    # met, its seed 1 (-1.5 pt) a note
    assert "a onebit (mean over seeds 0, 1): accuracy 0.8350 vs exact 0.8500 " \
        "(<= 0.01 accuracy below exact)" in missed, missed
    assert not any("hierarchical_1bit" in m for m in missed), missed
    notes = report.seed_notes(records)
    assert any(n.startswith("a hierarchical_1bit (seed 1): accuracy") for n in notes), notes
    # against PyTorch's hook: int8 is better on seed 0 and 5 points worse on seed 1, worse by
    # the mean but not beyond two seeds' spread: a note, not a miss
    assert not any("torch" in m for m in missed), missed
    assert any(n.startswith("a int8: worse than torch powerSGD_hook by the mean of 2 seeds")
               for n in notes), notes
    summary = {s["method"]: s for s in report.seed_summary(records)}
    assert summary["onebit"]["gap"] == pytest.approx(0.015)
    assert summary["onebit"]["worst_gap"] == pytest.approx(0.025)
    assert (summary["onebit"]["seeds_met"], summary["onebit"]["mean_meets_target"]) == (1, False)
    assert summary["hierarchical_1bit"]["gap"] == pytest.approx(0.0025)
    assert (summary["hierarchical_1bit"]["seeds_met"],
            summary["hierarchical_1bit"]["mean_meets_target"]) == (1, True)
    assert summary["exact"]["value"] == pytest.approx(0.85) and "seeds_met" not in summary["exact"]
    text = report.seed_table(report.seed_summary(records))
    assert "| a | onebit | accuracy | 0.8350 | 0.8500 | +1.5 pt | +2.5 pt | 1/2 | MISSED |" in text
    # a method that failed on one seed has no mean
    failed = report.compare(records[:2] + [_seeded("a", "onebit", 0.795, 0),
                                           {"task": "a", "method": "onebit", "failed": True,
                                            "seed": 1}])
    assert [s["method"] for s in report.seed_summary(failed)] == ["exact"]


def _four_seeds(task, method, values, nbytes, metric="accuracy"):
    return [dict(_record(task, method, v, metric, nbytes), seed=s) for s, v in enumerate(values)]


def test_pytorchs_hook_is_judged_by_a_paired_test_over_the_seeds(tmp_path):
    """Measured runs (docs/history/convergence-notebook.md; 2 nodes x 2 ranks, seeds 0-3): flat
    onebit on wide_mlp_bf16_step was below PyTorch's hook on every seed while sending more bytes
    (a real gap, fixed by the hierarchical route): a miss. int8 on regression_adam, at exact's
    mean, is above torch's loss on 2 seeds and below on 2: within the spread, a note."""
    records = report.compare(
        _four_seeds("wide", "exact", [0.8928, 0.8928, 0.8863, 0.8945], 11083816) +
        _four_seeds("wide", "onebit", [0.8830, 0.8855, 0.8823, 0.8830], 833032) +
        _four_seeds("wide", "torch_powerSGD", [0.8915, 0.8888, 0.8988, 0.8882], 741689) +
        _four_seeds("reg", "exact", [0.0812, 0.0806, 0.0810, 0.0833], 346176, "test_mse") +
        _four_seeds("reg", "int8", [0.0814, 0.0806, 0.0810, 0.0829], 91413, "test_mse") +
        _four_seeds("reg", "torch_powerSGD", [0.0810, 0.0807, 0.0811, 0.0825], 75174, "test_mse"))
    missed = report.check_targets(records)
    assert len(missed) == 1 and missed[0] == (
        "wide onebit (mean over seeds 0, 1, 2, 3): worse than torch powerSGD_hook "
        "(0.8834 vs 0.8918) at 833.0 vs 741.7 KB per step (paired t = 2.87 over 4 seeds)"), missed
    notes = report.seed_notes(records)
    assert any(n.startswith("reg int8: worse than torch powerSGD_hook by the mean of 4 seeds, "
                            "within their spread (paired t = 1.") for n in notes), notes
    report.write_outputs(records, str(tmp_path / "c.json"), str(tmp_path), png=False)
    text = (tmp_path / "convergence.md").read_text()
    assert "Targets missed:\n\n- wide onebit" in text and "within their spread" in text
    # the test's edges: every seed worse by the same amount; fewer bytes than torch's is no miss
    assert report.significantly_worse([0.01, 0.01]) and not report.significantly_worse([0.0, 0.0])
    cheaper = report.compare(
        _four_seeds("w", "exact", [0.9] * 4, 1000) + _four_seeds("w", "int4", [0.8] * 4, 10) +
        _four_seeds("w", "torch_powerSGD", [0.9] * 4, 50))
    assert not any("torch" in m for m in report.check_targets(cheaper))


def test_seeds_run_in_batches_are_judged_together(tmp_path):
    """convergence_report.py merges runs of other seeds into one judged set; a run present
    twice is refused."""
    first = _four_seeds("wide", "exact", [0.8928, 0.8928], 11083816) + \
        _four_seeds("wide", "onebit", [0.8830, 0.8855], 833032) + \
        _four_seeds("wide", "torch_powerSGD", [0.8915, 0.8888], 741689)
    second = [dict(r, seed=r["seed"] + 2) for r in
              _four_seeds("wide", "exact", [0.8863, 0.8945], 11083816) +
              _four_seeds("wide", "onebit", [0.8823, 0.8830], 833032) +
              _four_seeds("wide", "torch_powerSGD", [0.8988, 0.8882], 741689)]
    for name, records in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(records))
    out = tmp_path / "merged"
    rc = report.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out-dir", str(out),
                      "--no-png", "--check-targets"])
    assert rc == 1  # the four seeds together: the flat 1-bit shortfall of the test above
    merged = json.loads((out / "convergence.json").read_text())
    assert sorted({r["seed"] for r in merged}) == [0, 1, 2, 3]
    assert "(paired t = 2.87 over 4 seeds)" in (out / "convergence.md").read_text()
    # the first batch alone (two seeds) cannot tell the shortfall from the spread
    assert report.main([str(tmp_path / "a.json"), "--out-dir", str(tmp_path / "one"),
                        "--no-png", "--check-targets"]) == 0
    with pytest.raises(SystemExit, match="in another file too"):
        report.merge([str(tmp_path / "a.json"), str(tmp_path / "a.json")])


@pytest.mark.timeout(600)
def test_smoke_run_over_two_seeds(tmp_path):
    out = tmp_path / "conv"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.convergence", "--smoke", "--no-png",
         "--tasks", "regression_adam", "--steps", "4", "--methods", "exact,hierarchical_1bit",
         "--seeds", "0,1", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((out / "convergence.json").read_text())
    assert sorted((r["method"], r["seed"]) for r in records) == [
        ("exact", 0), ("exact", 1), ("hierarchical_1bit", 0), ("hierarchical_1bit", 1)]
    exact = {r["seed"]: r["value"] for r in records if r["method"] == "exact"}
    assert exact[0] != exact[1]  # other weights and batches
    for r in records:
        assert r["exact_value"] == exact[r["seed"]], r
    summaries = json.loads((out / "seeds.json").read_text())
    assert [(s["method"], s["seeds"]) for s in summaries] == [("exact", 2),
                                                               ("hierarchical_1bit", 2)]
    assert summaries[0]["value"] == pytest.approx((exact[0] + exact[1]) / 2)
    assert "Means over seeds 0, 1" in (out / "convergence.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "bench.convergence",
                          "--seeds", "0,0", "--out-dir", str(tmp_path / "bad")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "repeats a seed" in bad.stderr
    both = subprocess.run([sys.executable, "-m", "bench.convergence",
                           "--seed", "1", "--seeds", "0,1", "--out-dir", str(tmp_path / "bad")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert both.returncode != 0 and "not both" in both.stderr


def test_tasks_cover_what_the_suite_must():
    suite = list(tasks.TASKS.values())
    assert len([t for t in suite if not t.heldout]) >= 6 and any(t.heldout for t in suite)
    assert {t.kind for t in suite} >= {"classification", "lm", "regression"}
    assert {t.optimizer for t in suite} >= {"sgd", "adam", "adamw"}
    assert any(t.bf16 for t in suite) and any(not t.bf16 for t in suite)
    assert any(t.optimizer == "sgd" and t.schedule == "constant" for t in suite)
    assert any(t.optimizer == "sgd" and t.schedule != "constant" for t in suite)
    sizes = [sum(p.numel() for p in tasks.build_model(t).parameters()) for t in suite]
    assert min(sizes) < 150_000 and max(sizes) > 2_000_000, sizes


@pytest.mark.timeout(600)
def test_smoke_run_writes_every_method(tmp_path):
    out = tmp_path / "conv"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.convergence", "--smoke",
         "--tasks", "regression_adam", "--steps", "6", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads((out / "convergence.json").read_text())
    methods = [r["method"] for r in records]
    assert methods[0] == "exact" and "hierarchical_1bit" in methods and "onebit_adam" in methods
    assert "torch_powerSGD" in methods and "zero_one_adam" in methods
    for r in records:
        assert not r.get("failed"), r
        for key in ("task", "method", "metric", "value", "exact_value",
                    "inter_node_bytes_per_step"):
            assert key in r, (key, r)
        assert r["replicas_equal"], r
    by = {r["method"]: r for r in records}
    assert by["hierarchical_1bit"]["inter_node_bytes_per_step"] < \
        by["exact"]["inter_node_bytes_per_step"]
    assert (out / "convergence.md").exists() and (out / "convergence.png").stat().st_size > 10_000


def test_seed_moves_weights_and_batches_but_not_the_data():
    """--seed: seed 0 is the published run; another seed draws other weights and batch rows."""
    from dataclasses import replace
    task = tasks.TASKS["regression_adam"]
    other = replace(task, seed=3)
    data = tasks.load_data(task)
    first = lambda t: next(tasks.build_model(t).parameters()).detach().clone()  # noqa: E731
    assert torch.equal(first(task), tasks.build_model(task, 0).parameters().__next__().detach())
    assert not torch.equal(first(task), first(other))
    x0, _ = tasks.batch(task, data, 5, 0, 4)
    x0_again, _ = tasks.batch(replace(task, seed=0), data, 5, 0, 4)
    x3, _ = tasks.batch(other, data, 5, 0, 4)
    assert torch.equal(x0, x0_again) and not torch.equal(x0, x3)
    assert tasks.load_data(other)["test"][0].equal(data["test"][0])


def test_method_options_take_lists():
    from bench.convergence import worker
    assert worker.parse_method("onebit@phases=1;exclude=*.bias|0.weight;error_decay=0.25") == \
        ("onebit", {"phases": 1, "exclude": ("*.bias", "0.weight"), "error_decay": 0.25})


def test_smoke_leaves_out_only_the_slowest_tasks_unless_named():
    from bench.convergence import __main__ as convergence
    smoke = [t.name for t in convergence.select_tasks(None, smoke=True)]
    assert smoke == [n for n in tasks.TASKS if n not in ("charlm_adam_bf16", "moe_lm_adamw_bf16")]
    assert [t.name for t in convergence.select_tasks(None)] == list(tasks.TASKS)
    named = convergence.select_tasks("charlm_adam_bf16,regression_adam", smoke=True)
    assert [t.name for t in named] == ["charlm_adam_bf16", "regression_adam"]


def test_diloco_method_names_parse_into_options():
    from bench.convergence.diloco_methods import parse

    streamed = parse("diloco_int4_h16_f2_d1_k", {})
    assert (streamed["codec"], streamed["sync_every"], streamed["fragments"],
            streamed["fragment_sync_delay"], streamed["keep_local_progress"]) == ("int4", 16, 2, 1, True)
    assert parse("diloco_onebit_h4_d1", {})["keep_local_progress"] is False
    assert "codec" not in parse("diloco", {})  # DiLoCo's own defaults
    for bad in ("diloco_int4_h16_k", "diloco_int4", "diloco_int4_h16_d1_x"):  # _k needs a delay
        with pytest.raises(ValueError, match="a DiLoCo method is"):
            parse(bad, {})
