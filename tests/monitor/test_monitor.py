"""ciuicflow.monitor: records from real hook states, Prometheus over HTTP, stragglers and hangs on
real gloo processes, and the pure logic (traffic matrix, straggler rule, hang suspects)."""
import http.server
import json
import threading
import time
import urllib.request

import pytest
import torch
import torch.distributed as dist

from ciuicflow import cli
from ciuicflow.ddp.state import AllReduceState
from ciuicflow.monitor import Monitor, find_hang_suspects, find_stragglers, load_run, traffic_matrix
from ciuicflow.monitor.stragglers import HangWatchdog, Heartbeat, describe_hang
from tests.dist_utils import run_distributed


def _scrape(port: int) -> dict:
    """Sample name + sorted labels -> value, from the endpoint over HTTP."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


# -- real DDP hooks: records, Prometheus endpoint, run directory -----------------------------------


def _train_with_hook(rank, world, run_dir):
    import ciuicflow

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = ciuicflow.register(ddp, "hierarchical_1bit", warmup_steps=2, overlap=False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    mon = Monitor(run_dir, [state], prometheus_port=0, straggler_every=3, hang_timeout_s=30,
                  error_norm_every=1)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        with mon.step():
            with mon.phase("forward"):
                loss = ddp(torch.randn(16, 64, generator=generator)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mon.add_metrics(loss=loss)
    ports = [None] * world
    dist.all_gather_object(ports, mon.prometheus_port)
    scraped = [_scrape(port) for port in ports]  # every rank's endpoint, over HTTP
    dist.barrier()
    mon.close()
    return {"stats": state.stats(), "scraped": scraped, "ports": ports,
            "overhead_s": mon.overhead_s, "traffic_model": mon.traffic_model}


def test_monitor_records_hook_traffic_and_serves_prometheus(tmp_path):
    run_dir = str(tmp_path / "run")
    results = run_distributed(_train_with_hook, world_size=4, nodes=2, args=(run_dir,),
                              timeout=120)
    run = load_run(run_dir)
    assert run.world_size == 4 and run.ranks == [0, 1, 2, 3]
    assert run.node_of_rank == [0, 0, 1, 1] and run.traffic_model == "hierarchical"
    assert results[0]["traffic_model"] == "hierarchical"
    assert len(set(results[0]["ports"])) == 4
    for rank, result in enumerate(results):
        steps, stats = run.steps[rank], result["stats"]
        assert [s["step"] for s in steps] == list(range(6))
        # the per-step differences add up to the state's own cumulative counters
        for key in ("intra_node_bytes", "inter_node_bytes", "exact_inter_node_bytes"):
            assert sum(s[key] for s in steps) == pytest.approx(stats[key], rel=1e-9), key
        assert sum(s["comm_s"] for s in steps) == pytest.approx(stats["time_s"], rel=1e-6)
        assert all(s["intra_node_bytes"] > 0 and s["inter_node_bytes"] > 0 for s in steps)
        # warm-up steps are exact; then 1-bit shrinks inter-node traffic and leaves memory
        assert steps[0]["inter_node_compression_ratio"] == pytest.approx(1.0)
        assert steps[0]["error_feedback_norm"] is None
        assert steps[-1]["inter_node_compression_ratio"] > 4
        assert steps[-1]["error_feedback_norm"] > 0
        # the accuracy guard's measure: none during warm-up, the state's worst bucket after it
        assert steps[0]["relative_error"] is None
        assert steps[-1]["relative_error"] == pytest.approx(stats["relative_error"])
        assert steps[-1]["relative_error"] > 0
        assert all(0 <= s["comm_fraction"] <= 1 and s["step_s"] > 0 for s in steps)
        assert all("forward" in s["phases"] and "loss" in s["metrics"] for s in steps)
        assert run.ends[rank]["steps"] == 6
        # what rank r's endpoint says, seen from rank 0 over HTTP, equals what rank r recorded
        labels = (("link", "inter_node"), ("node", str(rank // 2)), ("rank", str(rank)))
        scraped = results[0]["scraped"][rank]
        assert scraped[("ciuicflow_bytes_sent_total", labels)] == pytest.approx(
            sum(s["inter_node_bytes"] for s in steps))
        node_rank = (("node", str(rank // 2)), ("rank", str(rank)))
        assert scraped[("ciuicflow_steps_total", node_rank)] == 6
        assert scraped[("ciuicflow_step_seconds_count", node_rank)] == 6
        assert scraped[("ciuicflow_step_seconds_sum", node_rank)] == pytest.approx(
            sum(s["step_s"] for s in steps))
        assert scraped[("ciuicflow_compression_ratio", node_rank)] == pytest.approx(
            steps[-1]["compression_ratio"])
        assert scraped[("ciuicflow_compression_relative_error", node_rank)] == pytest.approx(
            steps[-1]["relative_error"])
    assert not [a for a in run.alerts if a["kind"] == "hang"]  # (a loaded machine may straggle)
    # and the report reads the same directory
    summary_path = tmp_path / "summary.json"
    assert cli.main(["report", run_dir, "--no-charts", "--json", str(summary_path)]) == 0
    summary = json.loads(summary_path.read_text())
    assert summary["bytes_per_step"]["inter_node"] == pytest.approx(
        sum(r["stats"]["inter_node_bytes"] for r in results) / 24)


# -- stragglers and hangs on real gloo processes ----------------------------------------------------


def _slow_rank_then_hang(rank, world, run_dir):
    """Every step ends in an all-reduce, as DDP's do. Rank 2 is slow in 'data' for steps 0-7,
    then hangs in 'data' at step 9 for 4 s."""
    waited = {"time_s": 0.0}  # what a hook state reports: time in communication, waiting included

    mon = Monitor(run_dir, [lambda: dict(waited)], straggler_every=4, straggler_factor=2.0,
                  hang_timeout_s=1.5, heartbeat_s=0.1)
    x = torch.ones(1000)
    for step in range(10):
        with mon.step():
            with mon.phase("data"):
                if rank == 2:
                    time.sleep(4.0 if step == 9 else 0.08 if step < 8 else 0.0)
            with mon.phase("sync"):
                start = time.perf_counter()
                dist.all_reduce(x)
                waited["time_s"] += time.perf_counter() - start
    dist.barrier()
    mon.close()
    return {"alerts": mon.alerts, "windows": mon.last_windows}


def test_straggler_and_hang_are_reported_with_rank_node_and_phase(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    results = run_distributed(_slow_rank_then_hang, world_size=3, nodes=None,
                              node_sizes=[2, 1], args=(run_dir,), timeout=120)
    alerts = results[0]["alerts"]
    stragglers = [a for a in alerts if a["kind"] == "straggler"]
    hangs = [a for a in alerts if a["kind"] == "hang"]
    # two checks (steps 0-3 and 4-7) while rank 2 is slow: rank 2, node 1, phase 'data'
    assert [(a["rank"], a["node"], a["phase"], a["steps"]) for a in stragglers] == \
        [(2, 1, "data", [0, 3]), (2, 1, "data", [4, 7])]
    assert all(a["ratio"] > 2 for a in stragglers)
    # the hang: rank 2 stuck in 'data' at step 9, the others waiting in 'sync' of the same step
    assert len(hangs) == 1
    hang = hangs[0]
    assert (hang["rank"], hang["node"], hang["step"], hang["phase"]) == (2, 1, 9, "data")
    assert hang["stalled_s"] >= 1.5
    assert [(o["rank"], o["phase"], o["step"]) for o in hang["others"]] == \
        [(0, "sync", 9), (1, "sync", 9)]
    # only the watchdog rank speaks; the others still saw the gathered windows
    assert results[1]["alerts"] == [] and results[2]["alerts"] == []
    assert [w["rank"] for w in results[1]["windows"]] == [0, 1, 2]
    # alerts are in the run directory for the report
    recorded = load_run(run_dir).alerts
    assert [a["kind"] for a in recorded] == ["straggler", "straggler", "hang"]


# -- Pushgateway ------------------------------------------------------------------------------------


def test_pushes_to_a_gateway(tmp_path):
    received = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            body = self.rfile.read(int(self.headers["Content-Length"])).decode()
            received.append((self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        mon = Monitor(str(tmp_path), [], prometheus_push=f"127.0.0.1:{server.server_port}",
                      push_every=2)
        for _ in range(3):
            with mon.step():
                pass
        mon.close()  # the final push carries all 3 steps
    finally:
        server.shutdown()
        server.server_close()
    assert received, "nothing was pushed"
    path, body = received[-1]
    assert path == "/metrics/job/ciuicflow/rank/0"
    assert 'ciuicflow_steps_total{node="0",rank="0"} 3.0' in body


# -- single process: the record, error handling ------------------------------------------------------


class _CountingState(AllReduceState):
    """A hook state with scripted counters and an error buffer in its state_dict."""

    algorithm = "fake"

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.error = torch.full((4,), 0.5)

    def stats(self):
        self.calls += 1
        return {"intra_node_bytes": 1000 * self.calls, "inter_node_bytes": 100 * self.calls,
                "exact_intra_node_bytes": 1000 * self.calls,
                "exact_inter_node_bytes": 3200 * self.calls, "time_s": 0.002 * self.calls}

    def state_dict(self):
        return {"memory": {"b0": {"tensors": {"error": self.error, "q": torch.ones(100)}}}}


def test_step_record_differences_and_error_norm(tmp_path):
    state = _CountingState()
    mon = Monitor(str(tmp_path), [state], error_norm_every=2)
    for _ in range(3):
        with mon.step():
            time.sleep(0.005)
    mon.close()
    steps = load_run(str(tmp_path)).steps[0]
    assert [s["intra_node_bytes"] for s in steps] == [1000, 1000, 1000]
    assert [s["inter_node_compression_ratio"] for s in steps] == [32.0, 32.0, 32.0]
    assert steps[0]["compression_ratio"] == pytest.approx(4200 / 1100)
    assert all(s["comm_s"] == pytest.approx(0.002) for s in steps)
    assert all(s["compute_s"] == pytest.approx(s["step_s"] - 0.002) for s in steps)
    # the norm of the error buffer (not of warm-start q), every 2nd step
    assert [s["error_feedback_norm"] for s in steps] == [pytest.approx(1.0), None, pytest.approx(1.0)]


def test_other_sources_report_their_own_error_norm(tmp_path):
    class Optimizer:  # an optimizer's state_dict may copy every buffer: never read for the norm
        def stats(self):
            return {"inter_node_bytes": 10.0, "error_feedback_norm": 0.25}

        def state_dict(self):
            raise AssertionError("the monitor must not call an optimizer's state_dict")

    mon = Monitor(None, [Optimizer()], error_norm_every=1)
    mon.step_begin()
    assert mon.step_end()["error_feedback_norm"] == 0.25
    mon.close()


def test_counter_reset_counts_from_zero(tmp_path):
    counters = {"inter_node_bytes": 500.0}
    mon = Monitor(None, [lambda: dict(counters)])
    seen = []
    for value in (800.0, 50.0, 70.0):  # 50: reset_stats() ran, then 50 bytes were sent
        counters["inter_node_bytes"] = value
        mon.step_begin()
        seen.append(mon.step_end()["inter_node_bytes"])
    assert seen == [300.0, 50.0, 20.0]
    assert mon.recorder is None
    mon.close()


def test_steps_beyond_the_target_and_plan_changes_are_recorded():
    """A tensor's plan (``stats()["wire"]``) is recorded when it appears and each time it changes,
    with its reasons; steps sent beyond the method's own codec are counted per step."""
    one_bit = {"codec": "onebit", "phases": 1, "reasons": ["2 ranks exchange in one phase"]}
    int4 = {"codec": "int4", "phases": 1, "reasons": ["an adaptive optimizer steps it"]}
    stats = {"beyond_target_reductions": 0, "wire": {0: one_bit}}
    mon = Monitor(None, [lambda: {**stats, "wire": dict(stats["wire"])}])
    records = []
    for beyond, wire in ((0, {0: one_bit}), (0, {0: one_bit}), (3, {0: int4, 1: one_bit}),
                         (5, {0: int4, 1: one_bit})):
        stats.update(beyond_target_reductions=beyond, wire=wire)
        mon.step_begin()
        records.append(mon.step_end())
    mon.close()
    assert [r["beyond_target_reductions"] for r in records] == [0, 0, 3, 2]
    # the first plan was read when the monitor started; then only changes and new tensors
    assert [sorted(next(iter(r.get("wire", {None: {}}).values()))) for r in records] == \
        [[], [], [0, 1], []]
    assert next(iter(records[2]["wire"].values()))[0]["reasons"] == int4["reasons"]


def test_misuse_raises_clear_errors(tmp_path):
    with pytest.raises(TypeError, match="stats"):
        Monitor(None, [42])
    with pytest.raises(ValueError, match="traffic_model"):
        Monitor(None, [], traffic_model="ring")
    import socket

    with socket.socket() as taken:  # a busy port: a clear error, not a silent lack of metrics
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="cannot serve Prometheus metrics"):
            Monitor(None, [], prometheus_port=taken.getsockname()[1])
    mon = Monitor(None, [])
    with pytest.raises(RuntimeError, match="without step_begin"):
        mon.step_end()
    with pytest.raises(RuntimeError, match="outside a step"):
        with mon.phase("data"):
            pass
    with pytest.raises(ZeroDivisionError):
        with mon.step():
            1 / 0
    with mon.step():  # the failed step left no half-open state behind
        pass
    assert mon.steps == 1
    mon.close()
    with pytest.raises(RuntimeError, match="closed"):
        mon.step_begin()


# -- pure logic --------------------------------------------------------------------------------------


def _window(rank, busy, phases=None, node=0):
    return {"rank": rank, "node": node, "host": "h", "first_step": 0, "last_step": 9,
            "busy_s": busy, "step_s": 0.1, "phases": phases or {}}


def test_find_stragglers_rule():
    windows = [_window(0, 0.010), _window(1, 0.011), _window(2, 0.030), _window(3, 0.012)]
    alerts = find_stragglers(windows, factor=1.5, min_excess_s=0.005)
    assert [a["rank"] for a in alerts] == [2]
    assert alerts[0]["ratio"] == pytest.approx(0.030 / 0.0115)
    # just under the factor, or over it by less than the absolute floor: not a straggler
    assert find_stragglers(windows, factor=3.0) == []
    assert find_stragglers(windows, factor=1.5, min_excess_s=0.05) == []
    # the phase named is the one furthest above its own median
    phased = [_window(r, b, {"data": d, "forward": 0.01}) for r, b, d in
              [(0, 0.02, 0.001), (1, 0.02, 0.001), (2, 0.09, 0.07)]]
    assert find_stragglers(phased)[0]["phase"] == "data"
    with pytest.raises(ValueError, match="factor"):
        find_stragglers(windows, factor=1.0)


def test_find_hang_suspects_picks_the_rank_behind():
    positions = {0: {"step": 9, "ordinal": 4}, 1: {"step": 9, "ordinal": 4},
                 2: {"step": 9, "ordinal": 1}, 3: {"step": 9, "ordinal": 4, "closed": True}}
    assert find_hang_suspects(positions, {0: 11.0, 1: 11.0, 2: 11.0}, 10.0) == [2]
    # rank 2, behind, still moves: ranks 0 and 1 may be waiting for it, not hung themselves...
    assert find_hang_suspects(positions, {0: 11.0, 1: 11.0}, 10.0) == []
    # ...unless they stay stalled for twice the timeout
    assert find_hang_suspects(positions, {0: 20.0, 1: 11.0}, 10.0) == [0]
    assert find_hang_suspects(positions, {}, 10.0) == []
    assert find_hang_suspects(positions, {3: 50.0}, 10.0) == []  # closed


def test_a_pause_between_steps_is_not_a_hang():
    from ciuicflow.monitor.stragglers import BETWEEN_STEPS
    paused = {r: {"step": 7, "ordinal": -1, "phase": BETWEEN_STEPS} for r in range(3)}
    assert find_hang_suspects(paused, {0: 99.0, 1: 99.0, 2: 99.0}, 10.0) == []
    # one rank still between steps while the others wait inside step 8: that one is blamed
    waiting = {**paused, **{r: {"step": 8, "ordinal": 2, "phase": "sync"} for r in (1, 2)}}
    assert find_hang_suspects(waiting, {0: 11.0, 1: 11.0, 2: 11.0}, 10.0) == [0]
    # between steps, but at different steps: the rank behind never arrived
    apart = {**paused, 1: {"step": 8, "ordinal": -1, "phase": BETWEEN_STEPS}}
    assert find_hang_suspects(apart, {0: 11.0, 1: 11.0, 2: 11.0}, 10.0) == [0, 2]


def test_watchdog_on_a_store_with_a_fake_clock():
    store = dist.HashStore()
    now = [0.0]
    beats = [Heartbeat(store, r, 1.0) for r in range(3)]
    alerts = []
    info = [{"node": 0, "host": "a"}, {"node": 0, "host": "a"}, {"node": 1, "host": "b"}]
    watchdog = HangWatchdog(store, 3, timeout_s=10, interval_s=1, ranks_info=info,
                            on_alert=alerts.append, clock=lambda: now[0])
    watchdog.poll()
    for beat in beats:
        beat.move(0, "forward", 1)
        beat.publish()
    now[0] = 5.0
    assert watchdog.poll() == []
    beats[0].move(0, "sync", 2), beats[0].publish()
    beats[1].move(0, "sync", 2), beats[1].publish()
    now[0] = 16.0  # rank 2 silent since t=5, ranks 0 and 1 since t=16
    new = watchdog.poll()
    assert [(a["rank"], a["node"], a["phase"]) for a in new] == [(2, 1, "forward")]
    assert new[0]["stalled_s"] == pytest.approx(11.0)
    assert [(o["rank"], o["phase"], o["since_s"]) for o in new[0]["others"]] == \
        [(0, "sync", 0.0), (1, "sync", 0.0)]
    assert "others: ranks 0, 1 at step 0, phase 'sync'" in describe_hang(new[0])
    now[0] = 30.0  # same stall: no second alert; the others now wait too
    assert watchdog.poll() == []
    for beat in beats:  # the stall ends
        beat.move(1, "step", 0)
        beat.publish()
    now[0] = 31.0
    assert watchdog.poll() == [] and len(alerts) == 1
    beats[2].close()  # a closed rank is never a suspect; the others stall again
    now[0] = 42.0
    assert [a["rank"] for a in watchdog.poll()] == [0, 1]


def test_traffic_matrix_models():
    nodes = [0, 0, 1, 1]
    hier = traffic_matrix(nodes, [30.0, 30, 30, 30], [8.0, 8, 8, 8], "hierarchical")
    # rank 0: intra to rank 1 only, inter to rank 2 (same local rank on node 1) only
    assert hier[0] == [0.0, 30.0, 8.0, 0.0]
    assert hier[3] == [0.0, 8.0, 30.0, 0.0]
    flat = traffic_matrix(nodes, [30.0, 30, 30, 30], [8.0, 8, 8, 8], "flat")
    assert flat[0] == [0.0, 30.0, 4.0, 4.0]
    for matrix in (hier, flat):  # rows add up to what each rank recorded
        assert [sum(row) for row in matrix] == [38.0] * 4
    with pytest.raises(ValueError, match="no peers"):
        traffic_matrix([0, 0], [1.0, 1.0], [5.0, 0.0])
    with pytest.raises(ValueError, match="one intra"):
        traffic_matrix([0, 0], [1.0], [0.0, 0.0])
