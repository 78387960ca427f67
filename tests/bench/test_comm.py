"""python -m bench.comm --smoke end to end: every method runs (or is skipped/failed with a reason), the outputs exist,
and the bytes it reports are the bytes the algorithms must move."""
import json
import subprocess
import sys

import pytest

from tests import REPO

ROOT = str(REPO)
from bench.comm.__main__ import DEFAULT_METHODS  # noqa: E402
from bench.comm.worker import CIUICFLOW_HOOKS, method_label, parse_method

FIELDS = ("method", "step_seconds", "comm_seconds", "inter_node_bytes_per_step", "final_loss", "shaped")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    json_path = out / "smoke.json"
    proc = subprocess.run([sys.executable, "-m", "bench.comm", "--smoke", "--json",
                           str(json_path)], cwd=ROOT, capture_output=True, text=True, timeout=420)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(json_path.read_text()), out, proc


@pytest.mark.timeout(480)
def test_smoke_records_every_method(smoke):
    records, out, proc = smoke
    expected = [method_label(*parse_method(m)) for m in DEFAULT_METHODS.split(",")]
    assert [r["method"] for r in records] == expected
    by = {r["method"]: r for r in records}
    for name in ("allreduce", "fp16_compress_hook", "powerSGD_hook_r1", "powerSGD_hook_r4", "no_comm"):
        r = by[name]
        assert all(f in r for f in FIELDS), r
        assert r["step_seconds"] > 0 and r["comm_seconds"] >= 0 and r["final_loss"] == r["final_loss"]
    assert "waited" in by["powerSGD_hook_r1"]["note"]  # says how it was run on gloo
    for name, r in by.items():
        if r.get("hook") in CIUICFLOW_HOOKS:
            # a ciuicflow hook that failed or was skipped fails the bench's test
            assert "step_seconds" in r, f"ciuicflow method {name} not measured: {r}"
            assert all(f in r for f in FIELDS), r
    assert (out / "smoke.md").exists() and (out / "smoke.png").stat().st_size > 10_000


@pytest.mark.timeout(480)
def test_smoke_bytes_match_the_algorithms(smoke):
    records, _, proc = smoke
    by = {r["method"]: r for r in records}
    base = by["allreduce"]
    if not base["shaped"]:
        assert "NOT SHAPED" in proc.stdout and base["inter_node_bytes_per_step"] is None
        pytest.skip("loopback fallback: no inter-node link to count bytes on")
    # ring all-reduce over 4 ranks in node order: each node sends 2 (p-1)/p of the gradient across
    model_bytes = base["params"] * 4
    expected = base["nodes"] * 2 * 3 / 4 * model_bytes
    assert expected <= base["inter_node_bytes_per_step"] < 1.1 * expected
    fp16 = by["fp16_compress_hook"]["inter_node_bytes_per_step"]
    assert 0.45 < fp16 / base["inter_node_bytes_per_step"] < 0.55
    assert by["powerSGD_hook_r1"]["inter_node_bytes_per_step"] < by["powerSGD_hook_r4"]["inter_node_bytes_per_step"]
    assert by["powerSGD_hook_r4"]["inter_node_bytes_per_step"] < 0.2 * base["inter_node_bytes_per_step"]
    assert by["no_comm"]["inter_node_bytes_per_step"] < 0.01 * base["inter_node_bytes_per_step"]
    assert by["no_comm"]["comm_seconds"] < base["comm_seconds"]
    hier = by.get("hierarchical_allreduce", {})
    if "step_seconds" in hier:  # intra reduce-scatter, inter all-reduce of the shards: 2 (N-1)/N per node
        assert 0.95 * base["nodes"] * model_bytes <= hier["inter_node_bytes_per_step"] < 1.1 * base["nodes"] * model_bytes
    one = by["hierarchical_1bit"]
    assert one["inter_node_bytes_per_step"] < base["inter_node_bytes_per_step"] / 20
    # the planner was compared with this run
    assert "planner" in base and base["planner"]["predicted_inter_node_bytes"] > 0


def test_targets_are_judged_at_their_shape_only():
    """The 1/25 bytes and 1.3x no_comm targets are the issue's on 2 nodes x 2 ranks; on other
    shapes (1 bit's exchange sends more bytes beyond two nodes, by design) they are shown, not judged."""
    from bench.comm.__main__ import targets

    def records(nodes, ranks):
        shape = dict(nodes=nodes, ranks_per_node=ranks)
        return [dict(method="allreduce", inter_node_bytes_per_step=100.0, step_seconds=2.0, **shape),
                dict(method="no_comm", inter_node_bytes_per_step=0.0, step_seconds=1.0, **shape),
                dict(method="hierarchical_1bit", inter_node_bytes_per_step=10.0, step_seconds=1.5, **shape)]

    at_shape = targets(records(2, 2))
    assert [passed for _, passed in at_shape[:2]] == [False, False]  # 1/10 of the bytes; 1.5x
    elsewhere = targets(records(4, 2))
    assert [text for text, _ in elsewhere] == [text for text, _ in at_shape]
    assert all(passed is None for _, passed in elsewhere)


def test_rounds_combine_into_medians_and_ratios_within_rounds():
    """--rounds: one record per method, medians over the runs that finished, a failed run counted
    and left out, a method listed twice paired with the right round."""
    from bench.common.report import combine_rounds, per_round_ratios

    def run(method, step, cpu=0.5):
        return {"method": method, "step_seconds": step, "comm_seconds": step / 10, "cpu_seconds": cpu}

    records = [run("no_comm", 1.0), run("h1", 1.4), run("no_comm", 1.2),  # round 0 (no_comm twice)
               run("no_comm", 0.8), {"method": "h1", "failed": "boom"}, run("no_comm", 1.0),  # 1
               run("no_comm", 0.9, 0.4), run("h1", 1.1, 0.7), run("no_comm", 0.9)]  # round 2
    floor, h1 = combine_rounds(records, {"no_comm": 2, "h1": 1})
    assert floor["method"] == "no_comm" and floor["step_seconds"] == 0.95  # median of six
    assert floor["cpu_seconds"] == 0.5 and floor["failed_runs"] == 0
    assert [r["round"] for r in floor["rounds"]] == [0, 0, 1, 1, 2, 2]
    assert h1["step_seconds"] == 1.25 and h1["failed_runs"] == 1
    assert [r["round"] for r in h1["rounds"]] == [0, 2]
    assert per_round_ratios(h1, floor) == pytest.approx([1.4 / 1.1, 1.1 / 0.9])
    failed = combine_rounds([{"method": "x", "failed": "a"}, {"method": "x", "failed": "b"}])
    assert failed == [{"method": "x", "failed": "a"}]


def test_allreduce_cost_measures_the_compressor_and_the_exact_reduction(tmp_path):
    """bench/comm/allreduce_cost.py --smoke: a record per method (the compressor's, then the exact
    baseline's), every rank measured, the table written, bad sizes refused; --adaptive times the
    Adam plan in plain units and in the optimizer's."""
    json_path = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, "-m", "bench.comm.allreduce_cost",
                           "--smoke", "--flat", "--json", str(json_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(json_path.read_text())
    assert [r["method"] for r in records] == ["onebit", "exact"]
    for r in records:
        assert r["route"] == "flat" and r["numel"] == 1 << 20 and len(r["per_rank"]) == 4
        assert all(cpu > 0 and wall > 0 for cpu, wall in r["per_rank"])
    assert (tmp_path / "cost.md").read_text().count("| onebit |") == 1
    assert records[0]["plan"].startswith("onebit") and records[1]["plan"] is None
    adaptive = subprocess.run([sys.executable, "-m", "bench.comm.allreduce_cost", "--smoke",
                               "--adaptive", "--json", str(tmp_path / "adam.json")],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert adaptive.returncode == 0, adaptive.stderr[-4000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "adam.json").read_text())}
    # under Adam the 1-bit state sends int4, timed in plain units and in the optimizer's
    plain, units = rows["onebit (Adam, plain units)"], rows["onebit (Adam, optimizer's units)"]
    assert plain["plan"].startswith("int4") and units["plan"].startswith("int4")
    assert plain["in_units"] is False and units["in_units"] is True
    assert list(rows)[-1] == "exact"
    bad = subprocess.run([sys.executable, "-m", "bench.comm.allreduce_cost",
                          "--numel", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--numel" in bad.stderr
