"""bench/convergence/appendix.py: runs of several shapes merge into one page, each gap judged by the
line with the docs' signs, and the page depends only on the runs' files. Synthetic records: no
training."""
import json
import os

import pytest

from tests import REPO

ROOT = str(REPO)
from bench.convergence import appendix  # noqa: E402
from bench.convergence.tasks import TASKS  # noqa: E402


def _rec(task, method, value, seed=0, metric="accuracy", nbytes=1000.0, **extra):
    return {"task": task, "method": method, "metric": metric, "value": value, "seed": seed,
            "curve": [[1, value]], "inter_node_bytes_per_step": nbytes, **extra}


def _write_run(path, records, run_json=None, config_line=None, jsonl=False):
    os.makedirs(path, exist_ok=True)
    if jsonl:
        with open(os.path.join(path, "records.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    else:
        with open(os.path.join(path, "convergence.json"), "w") as f:
            json.dump(records, f)
    if run_json is not None:
        with open(os.path.join(path, "run.json"), "w") as f:
            json.dump(run_json, f)
    if config_line is not None:
        with open(os.path.join(path, "convergence.md"), "w") as f:
            f.write("config: " + json.dumps(config_line) + "\n\n| task | ...\n")
    return str(path)


def _rows(text, task):
    """The table rows of one task's section, by (method, shape)."""
    section = text.split(f"## {task}")[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0].strip("`"), cells[1])] = cells
    return rows


@pytest.fixture
def three_shapes(tmp_path):
    """2 x 2 with run.json and shaped records (seeds 0 and 1), 4 x 1 older than run.json (its shape
    in convergence.md's config line), 3 x 2 still running (records.jsonl, shape given by hand)."""
    a = _write_run(tmp_path / "n2r2", [
        _rec("mlp_sgd_constant", "exact", 0.80, 0, nbytes=8000, nodes=2, ranks_per_node=2),
        _rec("mlp_sgd_constant", "hierarchical_1bit", 0.795, 0, nbytes=400, nodes=2, ranks_per_node=2),
        _rec("mlp_sgd_constant", "exact", 0.82, 1, nbytes=8000, nodes=2, ranks_per_node=2),
        _rec("mlp_sgd_constant", "hierarchical_1bit", 0.806, 1, nbytes=400, nodes=2, ranks_per_node=2),
        _rec("charlm_adam_bf16", "exact", 2.0, 0, "val_loss", 5000, nodes=2, ranks_per_node=2),
        _rec("charlm_adam_bf16", "hierarchical_1bit", 2.05, 0, "val_loss", 650, nodes=2,
             ranks_per_node=2),
        _rec("charlm_adam_bf16", "hierarchical_int8", 2.03, 0, "val_loss", 1250, nodes=2,
             ranks_per_node=2)],
        run_json={"command": "python -m bench.convergence --seeds 0,1", "started": "2026-12-07T01:00:00+00:00",
                  "machine": "Linux x86_64, 2 CPUs", "torch": "2.5.0", "commit": "abc1234",
                  "nodes": 2, "ranks_per_node": 2, "seeds": [0, 1]})
    b = _write_run(tmp_path / "n4r1", [
        _rec("mlp_sgd_constant", "exact", 0.80, 0, nbytes=6000),
        _rec("mlp_sgd_constant", "hierarchical_1bit", 0.789, 0, nbytes=500, compression_ratio=11.5),
        _rec("charlm_adam_bf16", "exact", 2.0, 0, "val_loss", 4000),
        _rec("charlm_adam_bf16", "hierarchical_1bit", 1.95, 0, "val_loss", 500)],
        config_line={"nodes": 4, "ranks_per_node": 1, "seeds": [0]})
    c = _write_run(tmp_path / "n3r2", [
        _rec("mlp_sgd_constant", "exact", 0.80, 0, nbytes=7000),
        {"task": "mlp_sgd_constant", "method": "hierarchical_1bit", "failed": True, "seed": 0,
         "error": "boom"}], jsonl=True)
    return [a, b, c + "=3x2"]


def _render(args):
    return appendix.render([appendix.parse_run_arg(a) for a in args], "CMD")


def test_runs_of_three_shapes_merge_into_one_table_per_task(three_shapes):
    text = _render(three_shapes)
    rows = _rows(text, "mlp_sgd_constant")
    assert set(rows) == {("exact", "2 x 2"), ("exact", "4 x 1"), ("exact", "3 x 2"),
                         ("hierarchical_1bit", "2 x 2"), ("hierarchical_1bit", "4 x 1"),
                         ("hierarchical_1bit", "3 x 2")}
    # each shape's gap against its own shape's exact run; bytes against its exact's
    assert rows[("hierarchical_1bit", "4 x 1")][3:] == \
        ["0.7890", "0.8000", "-1.10 pt", "**MISS**", "500.0 B", "1/12.0", "11.5x"]
    assert rows[("hierarchical_1bit", "3 x 2")][6] == "FAILED (seed 0)"
    # the header names every run's command and facts, or says they were not recorded
    assert "`python -m bench.convergence --seeds 0,1`" in text and "commit abc1234" in text
    assert "n4r1` (4 x 1 ranks; seeds 0): command, date and machine not recorded" in text
    assert "n3r2` (3 x 2 ranks; seeds 0)" in text and "the run had not finished" in text
    # tuned and held-out tasks are marked as bench/convergence/tasks.py defines them
    assert "## mlp_sgd_constant (tuned)" in text and "## charlm_adam_bf16 (held out)" in text


def test_methods_keeps_those_rows_and_exact(three_shapes):
    runs = [appendix.parse_run_arg(a) for a in three_shapes]
    appendix.keep_methods(runs, ["hierarchical_1bit"])
    rows = _rows(appendix.render(runs, "CMD"), "charlm_adam_bf16")
    assert ("hierarchical_int8", "2 x 2") not in rows
    assert ("exact", "2 x 2") in rows and ("hierarchical_1bit", "2 x 2") in rows
    with pytest.raises(SystemExit, match="hierarchical_int9"):
        appendix.keep_methods([appendix.parse_run_arg(a) for a in three_shapes], ["hierarchical_int9"])


def test_a_miss_is_never_reported_within(three_shapes):
    text = _render(three_shapes)
    acc = _rows(text, "mlp_sgd_constant")
    loss = _rows(text, "charlm_adam_bf16")
    # accuracy: 1.1 points below exact misses; the means of two seeds (-0.5, -1.4: -0.95) meet
    assert acc[("hierarchical_1bit", "4 x 1")][6] == "**MISS**"
    assert acc[("hierarchical_1bit", "2 x 2")][2:7] == \
        ["0,1", "0.8005", "0.8100", "-0.95 pt (-0.50 pt / -1.40 pt)", "within"]
    # loss: above exact is positive; 2.5% above misses, 1.5% above and 2.5% below are within
    assert loss[("hierarchical_1bit", "2 x 2")][4:6] == ["+2.50%", "**MISS**"]
    assert loss[("hierarchical_int8", "2 x 2")][4:6] == ["+1.50%", "within"]
    assert loss[("hierarchical_1bit", "4 x 1")][4:6] == ["-2.50%", "within"]
    misses = text.split("Misses and failures:")[1].split("\nCoverage:")[0]
    assert "mlp_sgd_constant `hierarchical_1bit` on 4 x 1: MISS, -1.10 pt" in misses
    assert "charlm_adam_bf16 `hierarchical_1bit` on 2 x 2: MISS, +2.50%" in misses
    assert "mlp_sgd_constant `hierarchical_1bit` on 3 x 2: FAILED (seed 0)" in misses
    assert "on 4 x 1: MISS, -2.50%" not in misses and "hierarchical_int8" not in misses


def test_the_page_depends_only_on_the_runs(three_shapes, tmp_path):
    first = _render(three_shapes)
    assert _render(three_shapes) == first
    assert _render(list(reversed(three_shapes))) == first
    out = tmp_path / "page.md"
    assert appendix.main([*three_shapes, "--out", str(out)]) == 0
    assert out.read_text().split("\n", 3)[3] == first.split("\n", 3)[3]


def test_a_run_in_two_directories(tmp_path):
    exact = _rec("cnn_sgd_cosine", "exact", 0.97, nodes=2, ranks_per_node=2)
    one = _rec("cnn_sgd_cosine", "hierarchical_1bit", 0.968, nodes=2, ranks_per_node=2)
    failed = {"task": "cnn_sgd_cosine", "method": "hierarchical_int4", "failed": True, "seed": 0,
              "nodes": 2, "ranks_per_node": 2}
    rerun = _rec("cnn_sgd_cosine", "hierarchical_int4", 0.9705, nbytes=200, nodes=2, ranks_per_node=2)
    a = _write_run(tmp_path / "a", [exact, one, failed])
    b = _write_run(tmp_path / "b", [exact, rerun])          # exact again, and the failed run's rerun
    for order in ([a, b], [b, a]):
        rows = _rows(_render(order), "cnn_sgd_cosine")
        assert rows[("hierarchical_int4", "2 x 2")][4:6] == ["+0.05 pt", "within"]
        assert rows[("hierarchical_1bit", "2 x 2")][4:6] == ["-0.20 pt", "within"]
    c = _write_run(tmp_path / "c", [dict(one, value=0.95)])  # the same run, another result
    with pytest.raises(SystemExit, match="with another result"):
        _render([a, c])


def test_a_replacing_run_replaces_the_same_records_of_the_others(tmp_path):
    """A rerun after a method changed: its records win over the others' (wherever they are listed),
    the rest stays, and the header counts what it replaced; a failed rerun replaces nothing."""
    exact = _rec("cnn_adam_step", "exact", 0.96, nodes=2, ranks_per_node=2)
    old = _rec("cnn_adam_step", "hierarchical_1bit", 0.95, nbytes=900, nodes=2, ranks_per_node=2)
    other = _rec("mlp_sgd_constant", "hierarchical_1bit", 0.80, nodes=2, ranks_per_node=2)
    other_exact = _rec("mlp_sgd_constant", "exact", 0.81, nodes=2, ranks_per_node=2)
    a = _write_run(tmp_path / "a", [exact, old, other, other_exact])
    new = _rec("cnn_adam_step", "hierarchical_1bit", 0.958, nbytes=450, nodes=2, ranks_per_node=2)
    failed = {"task": "mlp_sgd_constant", "method": "hierarchical_1bit", "failed": True, "seed": 0,
              "nodes": 2, "ranks_per_node": 2}
    b = _write_run(tmp_path / "b", [new, failed])
    with pytest.raises(SystemExit, match="with another result"):
        _render([a, b])
    for runs in ([appendix.parse_run_arg(a), appendix.parse_run_arg(b, replacing=True)],
                 [appendix.parse_run_arg(b, replacing=True), appendix.parse_run_arg(a)]):
        text = appendix.render(runs, "CMD")
        assert _rows(text, "cnn_adam_step")[("hierarchical_1bit", "2 x 2")][4] == "-0.20 pt"
        assert _rows(text, "mlp_sgd_constant")[("hierarchical_1bit", "2 x 2")][4] == "-1.00 pt"
        assert "replaces 1 record(s) of the other runs" in text
    out = tmp_path / "page.md"
    assert appendix.main([a, "--replacing", b, "--out", str(out)]) == 0
    assert f"--replacing {b}" in out.read_text().splitlines()[2]


def test_convergence_py_records_its_shape_and_command(tmp_path, monkeypatch):
    """bench/convergence writes run.json (command, date, machine, commit) and the shape in each
    record; run_task stands in for training."""
    from bench.convergence import __main__ as convergence

    def fake_run_task(task, methods, nodes, ranks_per_node, out_path, steps=None, seed=0, **kw):
        # while it runs, run.json already names the command, and the run as unfinished
        started = json.loads((tmp_path / "run.json").read_text())
        assert started["seconds"] is None and started["command"].endswith("--no-png")
        with open(out_path, "a") as f:
            for i, m in enumerate(methods):
                f.write(json.dumps(_rec(task.name, m, 0.9 - 0.001 * i, seed)) + "\n")

    monkeypatch.setattr(convergence, "run_task", fake_run_task)
    argv = ["--tasks", "mlp_sgd_constant", "--methods", "exact,hierarchical_1bit", "--nodes", "3",
            "--ranks-per-node", "2", "--out-dir", str(tmp_path), "--no-png"]
    assert convergence.main(argv) == 0
    meta = json.loads((tmp_path / "run.json").read_text())
    assert meta["command"] == "python -m bench.convergence " + " ".join(argv)
    assert (meta["nodes"], meta["ranks_per_node"], meta["seeds"]) == (3, 2, [0])
    assert {"started", "machine", "torch", "commit"} <= set(meta) and meta["seconds"] is not None
    records = json.loads((tmp_path / "convergence.json").read_text())
    assert {(r["nodes"], r["ranks_per_node"]) for r in records} == {(3, 2)}
    rows = _rows(_render([str(tmp_path)]), "mlp_sgd_constant")
    assert rows[("hierarchical_1bit", "3 x 2")][2:6] == ["0.8990", "0.9000", "-0.10 pt", "within"]


def _earlier(tmp_path, rows, smallest=None):
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"from": "a page whose runs are gone", "runs": ["`/old/run` (2 x 2)"],
                                "rows": rows, "smallest_torch_rank": smallest or {}}))
    return appendix.Earlier(str(path))


def _old(task, method, shape, seeds, line="within", gap="+0.10 pt"):
    return {"task": task, "method": method, "shape": shape, "seeds": seeds,
            "cells": ["0.8000", "0.8000", gap, line, "1.0 KB", "1/8.0", "-"]}


def test_earlier_rows_are_kept_until_runs_cover_all_their_seeds(three_shapes, tmp_path):
    earlier = _earlier(tmp_path, [
        _old("mlp_sgd_constant", "hierarchical_1bit", [2, 2], [0]),           # the runs hold 0, 1
        _old("mlp_sgd_constant", "exact", [2, 2], [0, 1, 2]),                 # the runs lack 2
        _old("mlp_sgd_constant", "hierarchical_int4", [4, 1], [0, 1, 2], "**MISS**", "-1.50 pt"),
        _old("gru_lm_adam_step", "exact", [2, 2], [0]),                       # no run has the task
    ], {"mlp_sgd_constant": ["PyTorch's `powerSGD_hook` on 4 x 1, the smallest rank within the "
                             "line: **rank 2**, 1.0 KB per step."]})
    text = appendix.render([appendix.parse_run_arg(a) for a in three_shapes], "CMD", earlier)
    section = text.split("## mlp_sgd_constant")[1].split("\n## ")[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    assert "| `hierarchical_1bit` | 2 x 2 | 0,1 | " in section       # the runs' row, not the old one
    assert not any(line.startswith("| `hierarchical_1bit` | 2 x 2 | 0* |") for line in table)
    assert "| `exact` | 2 x 2 | 0,1 | " in section and "| `exact` | 2 x 2 | 0,1,2* | 0.8000 |" in section
    assert "| `hierarchical_int4` | 4 x 1 | 0,1,2* | 0.8000 | 0.8000 | -1.50 pt | **MISS** |" in section
    assert "on 4 x 1, the smallest rank within the line: **rank 2**, 1.0 KB per step. *" in section
    misses = text.split("Misses and failures:")[1].split("\nCoverage:")[0]
    assert "mlp_sgd_constant `hierarchical_int4` on 4 x 1: MISS, -1.50 pt (earlier run)" in misses
    assert "## gru_lm_adam_step (held out)" in text and "metric: val_loss." in text
    assert "- `/old/run` (2 x 2)" in text and "a page whose runs are gone" in text
    # without the earlier rows the page is the runs' alone
    assert "0,1,2*" not in _render(three_shapes)


def test_coverage_counts_the_tasks_and_names_the_closest_mean_and_every_miss(three_shapes, tmp_path):
    earlier = _earlier(tmp_path, [
        _old("gru_lm_adam_step", "hierarchical_1bit", [2, 2], [0, 1, 2], gap="+1.20%"),
        _old("regression_adam", "hierarchical_1bit", [2, 2], [0, 1, 2], gap="-3.00%"),
        _old("mlp_sgd_constant", "hierarchical_1bit", [4, 1], [0, 1, 2], gap="-0.20 pt"),
        _old("mlp_sgd_constant", "diloco", [2, 2], [0]),
    ])
    text = appendix.render([appendix.parse_run_arg(a) for a in three_shapes], "CMD", earlier)
    coverage = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
                for line in text.split("Coverage:")[1].split("\n## ")[0].splitlines()
                if line.startswith("| `")}
    # 2 x 2: two earlier tasks at 3 seeds, the runs' two at 1-2; charlm_adam_bf16's +2.50% misses
    # and is nearer the line (2%) than gru's +1.20% or the accuracy task's -0.95 points
    assert coverage[("`hierarchical_1bit`", "2 x 2")].startswith(
        f"| `hierarchical_1bit` | 2 x 2 | 2 | 2 | {len(appendix._task_order(TASKS)) - 4} "
        f"({len(TASKS)}) | **no**: charlm_adam_bf16 | charlm_adam_bf16 +2.50% (0) |")
    # 4 x 1: the earlier 3-seed row of mlp_sgd_constant counts, not the runs' 1-seed miss
    assert "| 1 | 1 |" in coverage[("`hierarchical_1bit`", "4 x 1")]
    assert "**no**: charlm_adam_bf16 |" not in coverage[("`hierarchical_1bit`", "4 x 1")]
    assert not any("diloco" in k[0] or "exact" in k[0] for k in coverage)


def test_the_committed_page_is_what_its_command_writes_from_the_repository(tmp_path, monkeypatch):
    """docs/convergence-results.md is written from runs kept in the repository: its own command
    writes it again, byte for byte (a page edited by hand, or a run quoted but not kept, fails)."""
    with open(os.path.join(ROOT, "docs", "convergence-results.md")) as f:
        text = f.read()
    command = text.split("Written by `", 1)[1].split("`", 1)[0].split()
    assert command[:3] == ["python", "-m", "bench.convergence.appendix"], command
    args = command[3:]
    runs = [a for i, a in enumerate(args)       # RUN_DIRs, --replacing's and --earlier's
            if i == 0 or args[i - 1] in ("--replacing", "--earlier") or
            not (a.startswith("-") or args[i - 1].startswith("-"))]
    assert runs and all(a.startswith("bench/results/convergence/") for a in runs), runs
    out = tmp_path / "page.md"
    args[args.index("--out") + 1] = str(out)
    monkeypatch.chdir(ROOT)       # the run paths as the header quotes them
    assert appendix.main(args) == 0
    assert out.read_text().replace(str(out), "docs/convergence-results.md") == text
