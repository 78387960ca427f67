"""ciuicflow report: summary figures and PNG charts from a recorded run directory."""
import json
import os
import time

import matplotlib.image
import pytest

from ciuicflow import cli
from ciuicflow.monitor import load_run, traffic_matrix
from ciuicflow.monitor.recorder import RunRecorder, rank_file
from ciuicflow.monitor.report import CHARTS

NODE_OF_RANK = [0, 0, 1, 1]
STEPS = 20


def _step(rank: int, step: int) -> dict:
    """Rank 3 is slow (40 ms steps, 30 ms busy); the others take 20 ms with 10 ms busy."""
    step_s = 0.040 if rank == 3 else 0.020
    comm_s = 0.010
    return {"type": "step", "step": step, "time": 1000.0 + step, "step_s": step_s,
            "comm_s": comm_s, "compute_s": step_s - comm_s, "comm_fraction": comm_s / step_s,
            "intra_node_bytes": 3000.0, "inter_node_bytes": 100.0 * (rank + 1),
            "exact_intra_node_bytes": 3000.0, "exact_inter_node_bytes": 3200.0 * (rank + 1),
            "compression_ratio": (3000 + 3200.0 * (rank + 1)) / (3000 + 100.0 * (rank + 1)),
            "inter_node_compression_ratio": 32.0,
            "error_feedback_norm": 0.5 + step if step % 5 == 0 else None}


def record_run(run_dir: str, run_id: str = "run-b", start_time: float = 2.0) -> None:
    for rank in range(4):
        meta = {"run_id": run_id, "rank": rank, "world_size": 4, "node": NODE_OF_RANK[rank],
                "local_rank": rank % 2, "node_of_rank": NODE_OF_RANK, "host": f"host{rank // 2}",
                "hosts": [f"host{r // 2}" for r in range(4)], "traffic_model": "hierarchical",
                "sources": ["onebit"], "start_time": start_time}
        recorder = RunRecorder(run_dir, rank, meta)
        for step in range(STEPS):
            recorder.step(_step(rank, step))
        if rank == 0:
            recorder.alert({"type": "alert", "kind": "straggler", "rank": 3, "node": 1,
                            "host": "host1", "phase": "forward", "steps": [10, 19],
                            "busy_s": 0.03, "median_busy_s": 0.01, "ratio": 3.0, "step_s": 0.04,
                            "phase_s": 0.025, "median_phase_s": 0.005, "time": 1015.0})
        recorder.close({"steps": STEPS, "overhead_s": 0.002, "gather_s": 0.0})


def test_report_draws_charts_and_prints_summary(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    record_run(run_dir)
    summary_path = tmp_path / "summary.json"
    assert cli.main(["report", run_dir, "--json", str(summary_path)]) == 0
    text = capsys.readouterr().out
    for name in CHARTS:
        path = os.path.join(run_dir, "report", name)
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
        height, width = matplotlib.image.imread(path).shape[:2]
        assert height >= 300 and width >= 400
    s = json.loads(summary_path.read_text())
    assert s["world_size"] == 4 and s["nodes"] == 2 and s["ranks_recorded"] == 4
    assert s["steps_per_rank"] == {str(r): STEPS for r in range(4)}
    # 60 steps of 20 ms and 20 of 40 ms
    assert s["step_s"]["median"] == pytest.approx(0.020)
    assert s["step_s"]["p90"] == pytest.approx(0.040) and s["step_s"]["max"] == pytest.approx(0.040)
    assert s["slowest_rank"]["rank"] == 3 and s["busiest_rank"]["rank"] == 3
    assert s["bytes_per_step"]["intra_node"] == pytest.approx(3000)
    assert s["bytes_per_step"]["inter_node"] == pytest.approx(250)  # mean of 100..400
    assert s["inter_node_compression_ratio"] == pytest.approx(32.0)
    ranks = {p["rank"]: p for p in s["per_rank"]}
    assert ranks[3]["comm_fraction"] == pytest.approx(0.25)
    assert ranks[0]["comm_fraction"] == pytest.approx(0.5)
    assert ranks[2]["last_error_feedback_norm"] == pytest.approx(15.5)
    assert ranks[1]["monitor_overhead_fraction"] == pytest.approx(0.002 / (STEPS * 0.020))
    assert s["alerts"]["straggler"] == 1 and s["alerts"]["hang"] == 0
    assert "straggler: rank 3 (node 1, host host1)" in text
    assert "median 20.00 ms" in text and "inter-node 250 B" in text


def test_traffic_matrix_of_the_report_equals_the_recorded_bytes(tmp_path):
    run_dir = str(tmp_path / "run")
    record_run(run_dir)
    run = load_run(run_dir)
    intra = [STEPS * 3000.0] * 4
    inter = [STEPS * 100.0 * (r + 1) for r in range(4)]
    matrix = traffic_matrix(run.node_of_rank, intra, inter, run.traffic_model)
    # rank 1 sends intra-node bytes to rank 0 only, inter-node bytes to rank 3 (same local rank)
    assert matrix[1] == [STEPS * 3000.0, 0.0, 0.0, STEPS * 200.0]


def test_skip_and_no_charts(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    record_run(run_dir)
    out = tmp_path / "s.json"
    assert cli.main(["report", run_dir, "--skip", "15", "--no-charts", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["steps_per_rank"]["0"] == 5
    assert not os.path.exists(os.path.join(run_dir, "report"))
    assert cli.main(["report", run_dir, "--skip", str(STEPS), "--no-charts"]) == 2
    assert "no steps" in capsys.readouterr().err


def test_torn_last_line_and_stale_files(tmp_path):
    run_dir = str(tmp_path / "run")
    record_run(run_dir)
    # a file from an earlier, larger run in the same directory
    stale = RunRecorder(run_dir, 7, {"run_id": "run-a", "rank": 7, "world_size": 8,
                                     "node_of_rank": [0] * 8, "start_time": 1.0})
    stale.close()
    with open(rank_file(run_dir, 2), "a", encoding="utf-8") as handle:
        handle.write('{"type": "step", "step": 20, "ste')  # the writer died mid-line
    with pytest.warns(UserWarning) as caught:
        run = load_run(run_dir)
    messages = " ".join(str(w.message) for w in caught)
    assert "incomplete" in messages and "another run" in messages
    assert run.ranks == [0, 1, 2, 3] and len(run.steps[2]) == STEPS


def test_errors(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no rank*.jsonl" in capsys.readouterr().err
    (tmp_path / "rank00000.jsonl").write_text('{"type": "step"}\n')
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "meta record" in capsys.readouterr().err


def test_report_of_a_live_single_process_run(tmp_path, capsys):
    from ciuicflow.monitor import Monitor

    # one process has no peers: bytes it claims cannot go into the matrix, the report still works
    counters = {"intra_node_bytes": 0.0, "time_s": 0.0}
    with Monitor(str(tmp_path), [lambda: dict(counters)]) as mon:
        for _ in range(12):
            with mon.step():
                time.sleep(0.002)
                counters["intra_node_bytes"] += 1000
                counters["time_s"] += 0.001
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "1 of 1 ranks recorded" in capsys.readouterr().out
    assert all(os.path.exists(os.path.join(tmp_path, "report", name)) for name in CHARTS)


@pytest.mark.parametrize("world, nodes, steps_of_rank", [
    (4, 2, lambda rank: 1 if rank == 3 else 150),        # a rank that died early: few points
    (20, 5, lambda rank: 60 + rank),                     # more ranks than lines: median and range
])
def test_uneven_and_large_runs_still_draw(tmp_path, world, nodes, steps_of_rank):
    run_dir = str(tmp_path / "run")
    node_of_rank = [r * nodes // world for r in range(world)]
    for rank in range(world):
        meta = {"run_id": "r", "rank": rank, "world_size": world, "node_of_rank": node_of_rank,
                "host": "h", "traffic_model": "flat", "start_time": 1.0}
        recorder = RunRecorder(run_dir, rank, meta)
        for step in range(steps_of_rank(rank)):
            recorder.step(dict(_step(rank % 4, step), inter_node_bytes=10.0 * rank))
        recorder.close()
    assert cli.main(["report", run_dir]) == 0
    for name in CHARTS:
        assert os.path.getsize(os.path.join(run_dir, "report", name)) > 10_000
