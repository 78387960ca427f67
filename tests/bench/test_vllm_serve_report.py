"""bench/vllm/report.py without vLLM: the goodput rate of a sweep (DistServe's definition: the highest
rate at which the SLO attainment stays >= the goal), its flow/fifo ratio with bounds, and SLO attainment
counting failed requests as misses."""
import json
import math
import os

import pytest

from bench.vllm.report import goodput_rate, goodput_rate_ratio, ratios, summarize, write_outputs

GOAL = 0.9


def test_interpolates_between_last_met_and_first_missed_level():
    # met at 0.2 (95%), missed at 0.3 (75%): 0.9 is a quarter of the way down -> 0.2 + 0.25 * 0.1
    g = goodput_rate([(0.1, 1.0), (0.2, 0.95), (0.3, 0.75), (0.4, 0.5)], GOAL)
    assert g["kind"] == "interpolated"
    assert g["rate_rps"] == pytest.approx(0.225)
    assert not g["met_above_miss"]


def test_points_in_any_order_and_exactly_at_goal():
    g = goodput_rate([(0.4, 0.5), (0.2, 0.9), (0.1, 1.0), (0.3, 0.7)], GOAL)
    assert g["rate_rps"] == pytest.approx(0.2)      # attainment exactly at the goal meets it


def test_every_level_met_is_a_lower_bound_at_the_highest_rate():
    g = goodput_rate([(0.1, 1.0), (0.3, 0.92), (0.2, 1.0)], GOAL)
    assert g == {"rate_rps": 0.3, "kind": "lower_bound", "met_above_miss": False}


def test_lowest_level_missed_gives_no_rate():
    g = goodput_rate([(0.1, 0.8), (0.2, 0.5)], GOAL)
    assert g["kind"] == "below_lowest"
    assert g["rate_rps"] is None
    assert g["below_rps"] == 0.1


def test_non_monotone_uses_the_first_crossing_from_below():
    # 0.3 misses, 0.4 meets again (noise): the crossing is between 0.2 and 0.3, and it is flagged
    g = goodput_rate([(0.1, 1.0), (0.2, 1.0), (0.3, 0.8), (0.4, 0.95), (0.5, 0.4)], GOAL)
    assert g["kind"] == "interpolated"
    assert g["rate_rps"] == pytest.approx(0.25)
    assert g["met_above_miss"]


def test_goodput_rate_needs_points():
    with pytest.raises(ValueError):
        goodput_rate([], GOAL)


def _g(rate, kind="interpolated", below=None):
    return {"rate_rps": rate, "kind": kind, "below_rps": below, "met_above_miss": False}


@pytest.mark.parametrize("flow, fifo, expected", [
    (_g(0.3), _g(0.2), (1.5, "exact")),
    # flow met every level up to 0.4: at least 0.4 / 0.2
    (_g(0.4, "lower_bound"), _g(0.2), (2.0, "lower_bound")),
    # fifo missed even at 0.1: flow's 0.3 is more than 3x fifo's
    (_g(0.3), _g(None, "below_lowest", 0.1), (3.0, "lower_bound")),
    (_g(0.4, "lower_bound"), _g(None, "below_lowest", 0.1), (4.0, "lower_bound")),
    # fifo met every level up to 0.4 and flow crossed at 0.3: at most 0.75
    (_g(0.3), _g(0.4, "lower_bound"), (0.75, "upper_bound")),
    (_g(None, "below_lowest", 0.1), _g(0.2), (0.5, "upper_bound")),
    # both met everywhere, or both missed everywhere: the sweep says nothing about the ratio
    (_g(0.4, "lower_bound"), _g(0.4, "lower_bound"), (None, "unknown")),
    (_g(None, "below_lowest", 0.1), _g(None, "below_lowest", 0.1), (None, "unknown")),
])
def test_ratio_and_its_bound(flow, fifo, expected):
    r = goodput_rate_ratio(flow, fifo)
    assert (r["ratio"] if r["ratio"] is None else pytest.approx(r["ratio"]), r["bound"]) == expected


def _req(cls, ttft, ok=True, run=0, arrival=0.0):
    if not ok:
        return {"ok": False, "error": "boom", "cls": cls, "arrival_s": arrival, "done_s": arrival + 1, "run": run}
    return {"ok": True, "cls": cls, "ttft_s": ttft, "tpot_s": 0.01, "arrival_s": arrival,
            "done_s": arrival + ttft + 0.2, "run": run}


SLO = {"high": 1.0, "low": 10.0}


def test_attainment_counts_failed_requests_as_misses():
    rs = [_req("high", 0.5), _req("high", 2.0), _req("low", 5.0), _req("low", 0, ok=False)]
    s = summarize(rs, SLO, 0.5)
    assert s["slo_met"] == 2
    assert s["failed"] == 1
    assert s["attainment"] == pytest.approx(2 / 4)       # not 2 / 3: the failed one was sent
    assert s["classes"]["low"]["slo_met"] == 1
    assert s["classes"]["high"]["slo_met"] == 1


def test_attainment_checks_tpot_too():
    slow = dict(_req("high", 0.5), tpot_s=0.6)
    assert summarize([slow, _req("high", 0.5)], SLO, 0.5)["attainment"] == pytest.approx(0.5)


def _level(load, rate, att_flow, att_fifo, n=10):
    """A sweep level whose modes met ``att * n`` of n requests (misses: TTFT over the SLO)."""
    modes = {}
    for mode, att in (("flow", att_flow), ("fifo", att_fifo)):
        met = round(att * n)
        rs = [_req("high", 0.5 if i < met else 3.0, arrival=i / rate) for i in range(n)]
        modes[mode] = {"requests": rs, **summarize(rs, SLO, 0.5)}
    return {"load": load, "rate_rps": rate, "requests_per_mode": n, "order": ["flow", "fifo", "fifo", "flow"],
            "modes": modes}


def _sweep():
    return {"slo_ttft_s": SLO, "slo_tpot_s": 0.5, "slo_attainment": GOAL,
            "levels": [_level(0.3, 0.1, 1.0, 1.0), _level(0.5, 0.2, 1.0, 0.8), _level(0.7, 0.3, 0.8, 0.5)]}


def test_sweep_ratios_from_the_levels():
    r = ratios(_sweep())
    # flow: met at 0.2, 80% at 0.3 -> 0.25; fifo: met at 0.1, 80% at 0.2 -> 0.15
    assert r["goodput_rate_modes"]["flow"]["rate_rps"] == pytest.approx(0.25)
    assert r["goodput_rate_modes"]["fifo"]["rate_rps"] == pytest.approx(0.15)
    assert r["goodput_rate"] == pytest.approx(0.25 / 0.15)
    assert r["goodput_rate_bound"] == "exact"
    assert [lv["load"] for lv in r["levels"]] == [0.3, 0.5, 0.7]
    assert "goodput" in r["levels"][1]                 # the single-rate figure, per level


def test_sweep_outputs(tmp_path, capsys):
    result = _sweep()
    write_outputs(result, str(tmp_path))
    out = capsys.readouterr().out
    assert "goodput rate at 90% SLO attainment 1.67x (target >= 1.5)" in out
    assert "fifo 0.150 req/s (interpolated)" in out
    assert out.count("goodput") >= 4                   # each level keeps the single-rate goodput line
    saved = json.loads((tmp_path / "vllm_serve.json").read_text())
    assert saved["ratios"]["goodput_rate"] == pytest.approx(0.25 / 0.15)
    assert (tmp_path / "vllm_serve.md").read_text().strip() == out.strip()
    pytest.importorskip("matplotlib")
    assert os.path.getsize(tmp_path / "vllm_serve.png") > 0


def test_single_rate_outputs_unchanged(tmp_path, capsys):
    level = _level(0.8, 0.2, 1.0, 0.5)
    result = {"slo_ttft_s": SLO, "slo_tpot_s": 0.5, **level}
    write_outputs(result, str(tmp_path))
    out = capsys.readouterr().out
    assert "goodput rate" not in out
    # fifo's misses end later (3 s TTFT), so its span is longer: goodput per second, not 10/5
    m = result["modes"]
    expected = (10 / m["flow"]["span_s"]) / (5 / m["fifo"]["span_s"])
    assert "flow/fifo: high TTFT p99" in out and f"goodput {expected:.2f}x (target >= 1.5)" in out
    assert set(result["ratios"]) == {"high_ttft_p99", "goodput"}
    assert not math.isnan(result["ratios"]["high_ttft_p99"])
