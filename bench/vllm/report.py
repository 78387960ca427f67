"""bench/vllm/serve.py's statistics and outputs: percentiles per class, throughput, goodput under an SLO
(at one rate: SLO-met requests per second; over a sweep of rates: DistServe's goodput, the highest rate at
which a goal share of the requests meets its SLOs); JSON, a Markdown table and a PNG."""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple


def pct(values: List[float], q: float):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(rs: List[dict], slo_ttft_s: Dict[str, float], slo_tpot_s: float) -> Dict:
    """``slo_ttft_s``: the TTFT SLO per class (a float: the same for every class). ``attainment``: the
    share of all requests sent that met both SLOs; a failed request is a miss (it is in ``rs``, not ok)."""
    ok = [r for r in rs if r.get("ok")]
    # runs of one mode (ABBA halves) each start at 0: their spans add up
    span = sum(max(r["done_s"] for r in run) - min(r["arrival_s"] for r in run) for run in _runs(rs))
    if not isinstance(slo_ttft_s, dict):
        slo_ttft_s = {r["cls"]: slo_ttft_s for r in rs}
    good = [r for r in ok if r["ttft_s"] <= slo_ttft_s[r["cls"]] and r["tpot_s"] <= slo_tpot_s]
    out = {"completed": len(ok), "failed": len(rs) - len(ok), "span_s": span,
           "throughput_rps": len(ok) / span if span > 0 else 0.0,
           "goodput_rps": len(good) / span if span > 0 else 0.0,
           "slo_met": len(good), "attainment": len(good) / len(rs) if rs else 0.0, "classes": {}}
    for cls in sorted({r["cls"] for r in rs}):
        c = [r for r in ok if r["cls"] == cls]
        out["classes"][cls] = {
            "n": len(c),
            "ttft_p50_ms": _ms(pct([r["ttft_s"] for r in c], 0.5)),
            "ttft_p99_ms": _ms(pct([r["ttft_s"] for r in c], 0.99)),
            "tpot_p50_ms": _ms(pct([r["tpot_s"] for r in c], 0.5)),
            "tpot_p99_ms": _ms(pct([r["tpot_s"] for r in c], 0.99)),
            "slo_met": sum(1 for r in c if r in good)}
    return out


def _runs(rs: List[dict]) -> List[List[dict]]:
    out: Dict[int, List[dict]] = {}
    for r in rs:
        out.setdefault(r.get("run", 0), []).append(r)
    return [v for v in out.values() if v]


def _ms(v):
    return None if v is None else round(v * 1e3, 1)


def goodput_rate(points: Sequence[Tuple[float, float]], goal: float) -> Dict:
    """DistServe's goodput (Zhong et al., OSDI'24) of one mode: the highest request rate at which the SLO
    attainment is still >= ``goal``, from ``points`` = [(rate, attainment), ...] measured at a few rates.

    Walks up from the lowest rate to the first level that misses the goal (a level further up that meets
    it again is noise: the first crossing counts, ``met_above_miss`` says it happened) and interpolates
    linearly between the last level meeting the goal and that one. ``kind`` says what ``rate_rps`` is:
      "interpolated"  the crossing, between two measured levels;
      "lower_bound"   every level met the goal: ``rate_rps`` is the highest rate measured, the true
                      goodput rate is at least that;
      "below_lowest"  even the lowest level missed: ``rate_rps`` is None, the true goodput rate is below
                      ``below_rps`` (the lowest rate measured).
    """
    pts = sorted(points)
    if not pts:
        raise ValueError("goodput_rate needs at least one (rate, attainment) point")
    miss = next((i for i, (_, a) in enumerate(pts) if a < goal), None)
    if miss is None:
        return {"rate_rps": pts[-1][0], "kind": "lower_bound", "met_above_miss": False}
    met_above = any(a >= goal for _, a in pts[miss + 1:])
    if miss == 0:
        return {"rate_rps": None, "kind": "below_lowest", "below_rps": pts[0][0], "met_above_miss": met_above}
    (r0, a0), (r1, a1) = pts[miss - 1], pts[miss]
    rate = r0 + (a0 - goal) / (a0 - a1) * (r1 - r0)       # a0 >= goal > a1
    return {"rate_rps": rate, "kind": "interpolated", "met_above_miss": met_above}


def _interval(g: Dict) -> Tuple[float, float]:
    """The goodput rates a goodput_rate() result allows: [low, high]."""
    if g["kind"] == "interpolated":
        return g["rate_rps"], g["rate_rps"]
    if g["kind"] == "lower_bound":
        return g["rate_rps"], math.inf
    return 0.0, g["below_rps"]


def goodput_rate_ratio(flow: Dict, fifo: Dict) -> Dict:
    """flow/fifo of two goodput_rate() results. When either is a bound, so is the ratio: ``bound`` is
    "exact", "lower_bound" (the ratio is at least ``ratio``), "upper_bound" (at most) or "unknown" (e.g.
    both met the goal at every level: the sweep did not reach either mode's goodput rate; ratio None)."""
    f_lo, f_hi = _interval(flow)
    b_lo, b_hi = _interval(fifo)
    lo = f_lo / b_hi                                     # x / inf = 0
    hi = f_hi / b_lo if b_lo > 0 else math.inf
    if lo == hi:
        return {"ratio": lo, "bound": "exact"}
    if lo > 0 and hi == math.inf:
        return {"ratio": lo, "bound": "lower_bound"}
    if lo == 0 and hi < math.inf:
        return {"ratio": hi, "bound": "upper_bound"}
    return {"ratio": None, "bound": "unknown"}


def sweep_points(result: Dict, mode: str) -> List[Tuple[float, float]]:
    """[(offered rate, attainment), ...] of one mode over the sweep's levels."""
    return [(lv["rate_rps"], lv["modes"][mode]["attainment"]) for lv in result["levels"] if mode in lv["modes"]]


def single_rate_ratios(result: Dict) -> Dict[str, float]:
    """The two figures at one rate: flow control's high-priority TTFT p99 and goodput (SLO-met
    requests per second) over FIFO's."""
    m = result.get("modes", {})
    try:
        hi = m["flow"]["classes"]["high"]["ttft_p99_ms"] / m["fifo"]["classes"]["high"]["ttft_p99_ms"]
        good = m["flow"]["goodput_rps"] / m["fifo"]["goodput_rps"] if m["fifo"]["goodput_rps"] else float("inf")
    except (KeyError, TypeError, ZeroDivisionError):
        return {}
    return {"high_ttft_p99": hi, "goodput": good}


def ratios(result: Dict) -> Dict:
    """One rate: single_rate_ratios. A sweep: the goodput rate ratio (the "request throughput
    within the SLO"), each mode's goodput rate, and every level's single-rate ratios."""
    if "levels" not in result:
        return single_rate_ratios(result)
    goal = result.get("slo_attainment", 0.9)
    modes = {mode: goodput_rate(sweep_points(result, mode), goal) for mode in ("flow", "fifo")
             if sweep_points(result, mode)}
    out: Dict = {"goodput_rate": None, "goodput_rate_bound": "unknown", "goodput_rate_modes": modes,
                 "slo_attainment": goal,
                 "levels": [{"load": lv["load"], "rate_rps": lv["rate_rps"], **single_rate_ratios(lv)}
                            for lv in result["levels"]]}
    if "flow" in modes and "fifo" in modes:
        r = goodput_rate_ratio(modes["flow"], modes["fifo"])
        out.update(goodput_rate=r["ratio"], goodput_rate_bound=r["bound"])
    return out


def _mode_rows(part: Dict, slo: str) -> List[str]:
    rows = ["| mode | class | n | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | SLO met |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, m in part["modes"].items():
        for cls, c in m["classes"].items():
            rows.append(f"| {mode} | {cls} | {c['n']} | {c['ttft_p50_ms']} | {c['ttft_p99_ms']} | {c['tpot_p50_ms']} | "
                        f"{c['tpot_p99_ms']} | {c['slo_met']} |")
    rows.append("")
    rows.append("| mode | completed | failed | throughput req/s | goodput req/s | SLO attainment |")
    rows.append("| --- | --- | --- | --- | --- | --- |")
    for mode, m in part["modes"].items():
        sent = m["completed"] + m["failed"]
        rows.append(f"| {mode} | {m['completed']} | {m['failed']} | {m['throughput_rps']:.3f} | "
                    f"{m['goodput_rps']:.3f} | {m.get('slo_met', '?')}/{sent} ({m.get('attainment', 0):.0%}) |")
    r = single_rate_ratios(part)
    if r:
        rows.append("")
        rows.append(f"flow/fifo: high TTFT p99 {r['high_ttft_p99']:.2f}x (target <= 0.5), goodput "
                    f"{r['goodput']:.2f}x (target >= 1.5); {slo}, {part.get('rate_rps', 0):.3f} req/s")
    return rows


def _ratio_text(value: Optional[float], bound: str) -> str:
    if value is None:
        return "unknown (the levels do not bracket either mode's goodput rate)"
    return {"lower_bound": ">= ", "upper_bound": "<= "}.get(bound, "") + f"{value:.2f}x"


def _mode_rate(g: Dict) -> str:
    if g["kind"] == "below_lowest":
        return f"< {g['below_rps']:.3f} req/s (even the lowest level missed)"
    text = f"{g['rate_rps']:.3f} req/s"
    text += " (every level met: a lower bound)" if g["kind"] == "lower_bound" else " (interpolated)"
    return text + (" [a higher level met the goal again]" if g["met_above_miss"] else "")


def table(result: Dict) -> str:
    slo = f"TTFT SLO {result.get('slo_ttft_s')}, TPOT SLO {result.get('slo_tpot_s')} s"
    if "levels" not in result:
        return "\n".join(_mode_rows(result, slo))
    rows: List[str] = []
    for lv in result["levels"]:
        rows += [f"load {lv['load']:g}: {lv['rate_rps']:.3f} req/s, {lv['requests_per_mode']} requests per mode", ""]
        rows += _mode_rows(lv, slo) + [""]
    modes = ("flow", "fifo")
    rows.append("| load | rate req/s | requests per mode | " + " | ".join(f"{m} SLO attainment" for m in modes) + " |")
    rows.append("| --- | --- | --- | " + " | ".join("---" for _ in modes) + " |")
    for lv in result["levels"]:
        cells = [f"{lv['modes'][m]['attainment']:.0%}" if m in lv["modes"] else "-" for m in modes]
        rows.append(f"| {lv['load']:g} | {lv['rate_rps']:.3f} | {lv['requests_per_mode']} | "
                    + " | ".join(cells) + " |")
    r = ratios(result)
    goal = r["slo_attainment"]
    rows.append("")
    rows.append(f"flow/fifo: goodput rate at {goal:.0%} SLO attainment "
                f"{_ratio_text(r['goodput_rate'], r['goodput_rate_bound'])} (target >= 1.5); " +
                ", ".join(f"{m} {_mode_rate(g)}" for m, g in r["goodput_rate_modes"].items()) + f"; {slo}")
    return "\n".join(rows)


def write_outputs(result: Dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    result["ratios"] = ratios(result)
    with open(os.path.join(out_dir, "vllm_serve.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    text = table(result)
    with open(os.path.join(out_dir, "vllm_serve.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig = _sweep_figure(plt, result) if "levels" in result else _bars_figure(plt, result)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "vllm_serve.png"), dpi=100)
    plt.close(fig)


def _bars_figure(plt, result: Dict):
    """One rate: TTFT and TPOT p99 per class and mode."""
    modes = list(result["modes"])
    classes = sorted({c for m in result["modes"].values() for c in m["classes"]})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("ttft_p99_ms", "tpot_p99_ms")):
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            vals = [result["modes"][mode]["classes"].get(c, {}).get(metric) or 0 for c in classes]
            ax.bar([k + i * width for k in range(len(classes))], vals, width, label=mode)
        ax.set_xticks([k + width * (len(modes) - 1) / 2 for k in range(len(classes))], classes)
        ax.set_title(metric.replace("_", " "))
        ax.legend()
    return fig


def _sweep_figure(plt, result: Dict):
    """A sweep: SLO attainment vs rate (the goal line and each mode's goodput rate marked), and TTFT p99
    per class vs rate."""
    r = result.get("ratios") or ratios(result)
    goal = r["slo_attainment"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"flow": "C0", "fifo": "C1"}       # one colour per mode in both panels
    for mode, g in r["goodput_rate_modes"].items():
        pts = sorted(sweep_points(result, mode))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[mode], label=mode)
        if g["rate_rps"] is not None:
            ax.axvline(g["rate_rps"], color=colors[mode], linestyle=":", linewidth=1)
    ax.axhline(goal, color="grey", linestyle="--", linewidth=1, label=f"goal {goal:.0%}")
    ax.set_xlabel("request rate req/s")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.set_title("SLO attainment vs rate (dotted: goodput rate)")
    ax.legend()
    levels = result["levels"]
    for mode in ("flow", "fifo"):
        for cls in ("high", "low"):
            pts = [(lv["rate_rps"], lv["modes"][mode]["classes"][cls]["ttft_p99_ms"]) for lv in levels
                   if cls in lv["modes"].get(mode, {}).get("classes", {})]
            pts = sorted(p for p in pts if p[1] is not None)
            if pts:
                ax2.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], "o-" if cls == "high" else "s--",
                         color=colors[mode], label=f"{mode} {cls}")
    ax2.set_xlabel("request rate req/s")
    ax2.set_ylabel("TTFT p99 s")
    ax2.set_yscale("log")
    ax2.set_title("TTFT p99 per class vs rate")
    ax2.legend(fontsize=8)
    return fig
