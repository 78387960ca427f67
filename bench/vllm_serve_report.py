"""bench/vllm_serve.py's statistics and outputs: percentiles per class, throughput, goodput under an SLO;
JSON, a Markdown table and a PNG."""
from __future__ import annotations

import json
import os
from typing import Dict, List


def pct(values: List[float], q: float):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(rs: List[dict], slo_ttft_s: Dict[str, float], slo_tpot_s: float) -> Dict:
    """``slo_ttft_s``: the TTFT SLO per class (a float: the same for every class)."""
    ok = [r for r in rs if r.get("ok")]
    # runs of one mode (ABBA halves) each start at 0: their spans add up
    span = sum(max(r["done_s"] for r in run) - min(r["arrival_s"] for r in run) for run in _runs(rs))
    if not isinstance(slo_ttft_s, dict):
        slo_ttft_s = {r["cls"]: slo_ttft_s for r in rs}
    good = [r for r in ok if r["ttft_s"] <= slo_ttft_s[r["cls"]] and r["tpot_s"] <= slo_tpot_s]
    out = {"completed": len(ok), "failed": len(rs) - len(ok), "span_s": span,
           "throughput_rps": len(ok) / span if span > 0 else 0.0,
           "goodput_rps": len(good) / span if span > 0 else 0.0, "classes": {}}
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


def table(result: Dict) -> str:
    rows = ["| mode | class | n | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | SLO met |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, m in result["modes"].items():
        for cls, c in m["classes"].items():
            rows.append(f"| {mode} | {cls} | {c['n']} | {c['ttft_p50_ms']} | {c['ttft_p99_ms']} | {c['tpot_p50_ms']} | "
                        f"{c['tpot_p99_ms']} | {c['slo_met']} |")
    rows.append("")
    rows.append("| mode | completed | failed | throughput req/s | goodput req/s |")
    rows.append("| --- | --- | --- | --- | --- |")
    for mode, m in result["modes"].items():
        rows.append(f"| {mode} | {m['completed']} | {m['failed']} | {m['throughput_rps']:.3f} | {m['goodput_rps']:.3f} |")
    r = ratios(result)
    if r:
        rows.append("")
        rows.append(f"flow/fifo: high TTFT p99 {r['high_ttft_p99']:.2f}x (target <= 0.5), goodput "
                    f"{r['goodput']:.2f}x (target >= 1.5); TTFT SLO {result.get('slo_ttft_s')}, "
                    f"TPOT SLO {result.get('slo_tpot_s')} s, {result.get('rate_rps', 0):.3f} req/s")
    return "\n".join(rows)


def ratios(result: Dict) -> Dict[str, float]:
    """Issue #16's two figures: flow control's high-priority TTFT p99 and goodput over FIFO's."""
    m = result.get("modes", {})
    try:
        hi = m["flow"]["classes"]["high"]["ttft_p99_ms"] / m["fifo"]["classes"]["high"]["ttft_p99_ms"]
        good = m["flow"]["goodput_rps"] / m["fifo"]["goodput_rps"] if m["fifo"]["goodput_rps"] else float("inf")
    except (KeyError, TypeError, ZeroDivisionError):
        return {}
    return {"high_ttft_p99": hi, "goodput": good}


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
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "vllm_serve.png"), dpi=100)
    plt.close(fig)
