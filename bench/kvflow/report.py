"""The KV-flow benchmark's records and outputs: per-phase statistics, the raw-loopback summary, targets, the
markdown table and the latency chart."""
from __future__ import annotations

import json
import math
import os

from bench.kvflow.workload import BYTES_PER_TOKEN, request_bytes


def percentile(values, q: float):
    """Nearest-rank percentile (with fewer than 100 samples p99 is the maximum)."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def phase_records(phase: dict, result: dict, base: dict) -> list:
    t0 = result["t0"]
    rows = {}
    ends = []
    for req in phase["requests"]:
        s = result["sent"].get(req["key"], {})
        r = result["received"].get(req["key"], {})
        arrival = t0 + req["at"]
        ok = bool(r.get("ok")) and s.get("done") is not None and r.get("bytes") == request_bytes(req["tokens"])
        row = {"priority": req["priority"], "ok": ok, "bytes": request_bytes(req["tokens"]),
               "latency": (r["last"] - arrival) if ok else None,
               "ttfl": (r["first_layer"] - arrival) if ok and r.get("first_layer") else None,
               "sender_latency": (s["done"] - arrival) if s.get("done") else None,
               "submit_lag": (s["submitted"] - arrival) if s.get("submitted") else None,
               "error": s.get("error") or r.get("error")}
        rows.setdefault(req["priority"], []).append(row)
        if ok:
            ends.append(r["last"])
    window = (max(ends) - t0) if ends else None
    out = []
    all_rows = [row for group in rows.values() for row in group]
    groups = list(rows.items()) + ([("all", all_rows)] if len(rows) > 1 else [])
    for priority, group in groups:
        lat = [x["latency"] for x in group if x["latency"] is not None]
        ttfl = [x["ttfl"] for x in group if x["ttfl"] is not None]
        delivered = sum(x["bytes"] for x in group if x["ok"])
        rec = dict(base)
        rec.update({
            "priority": priority, "aggregate": priority == "all", "requests": len(group), "lost": sum(1 for x in group if not x["ok"]),
            "p50_s": percentile(lat, 0.50), "p99_s": percentile(lat, 0.99), "max_s": max(lat) if lat else None,
            "ttfl_p50_s": percentile(ttfl, 0.50), "ttfl_p99_s": percentile(ttfl, 0.99),
            "ttfl_max_s": max(ttfl) if ttfl else None,
            "bytes": delivered, "window_s": window,
            "goodput_bytes_per_s": delivered / window if window else 0.0,
            "link_bytes_per_s": (result["link_tx_bytes"] / window) if window and result["link_tx_bytes"] else None,
            "max_submit_lag_s": max((x["submit_lag"] for x in group if x["submit_lag"] is not None), default=None),
            "latencies_s": sorted(lat),
            "errors": sorted({x["error"] for x in group if x["error"]})[:5],
            "sender_sidecar": result.get("sidecar"),
            "cpu_s": result.get("cpu_s"),
            "cpu_s_by_process": result.get("cpu_s_by_process"),
        })
        rate = rec.get("link_rate_bytes_per_s")
        rec["link_utilisation"] = (rec["link_bytes_per_s"] / rate) if rate and rec["link_bytes_per_s"] else None
        rec["goodput_fraction_of_link"] = (rec["goodput_bytes_per_s"] / rate) if rate else None
        out.append(rec)
    return out


def raw_records(raw_recs, plain, requests, raw_base, log) -> list:
    """The raw loopback summary: per ciuicflow mode its best repetition (with the leanest one's CPU per GB),
    and the plain gRPC baseline's record."""
    out = []
    for mode in ("flow", "fifo"):
        reps = [r for r in raw_recs if r["mode"] == mode]
        best = max(reps, key=lambda r: r["goodput_bytes_per_s"])
        best = dict(best, lost=sum(r["lost"] for r in reps), reps=[r["goodput_bytes_per_s"] for r in reps])
        lean = min((r for r in reps if r["bytes"]), key=lambda r: r["cpu_s"] / r["bytes"])
        best["cpu_s_per_gb"] = lean["cpu_s"] / (lean["bytes"] / 1e9)
        best["cpu_s_per_gb_by_process"] = {k: v / (lean["bytes"] / 1e9)
                                           for k, v in lean["cpu_s_by_process"].items()}
        out.append(best)
        log(f"raw loopback {mode}: best {best['goodput_bytes_per_s'] / 1e6:.1f} MB/s of "
            f"{[round(r / 1e6, 1) for r in best['reps']]}; CPU s/GB {best['cpu_s_per_gb']:.2f} = "
            + " + ".join(f"{v:.2f} {k}" for k, v in best["cpu_s_per_gb_by_process"].items()))
    good = [p for p in plain if p["bytes"] == p["expected"]]
    rates = [p["bytes"] / p["seconds"] for p in good]
    lean = min(good, key=lambda p: p["cpu_s"] / p["bytes"], default=None)
    out.append(dict(raw_base, phase="raw_loopback", mode="plain_grpc", priority="all", requests=len(requests),
                    lost=sum(1 for p in plain if p["bytes"] != p["expected"]) * len(requests),
                    p50_s=None, p99_s=None, max_s=None,
                    goodput_bytes_per_s=max(rates) if rates else 0.0, link_bytes_per_s=None,
                    bytes=plain[0]["expected"], reps=rates,
                    cpu_s_per_gb=lean["cpu_s"] / (lean["bytes"] / 1e9) if lean else None,
                    cpu_s_per_gb_by_process={k: v / (lean["bytes"] / 1e9)
                                             for k, v in lean["cpu_s_by_process"].items()} if lean else None,
                    window_s=min(p["seconds"] for p in good) if good else None))
    log(f"raw loopback plain gRPC: {[round(r / 1e6, 1) for r in rates]} MB/s, CPU s/GB "
        f"{out[-1]['cpu_s_per_gb'] or 0:.2f} = "
        + " + ".join(f"{v:.2f} {k}" for k, v in (out[-1]["cpu_s_per_gb_by_process"] or {}).items()))
    return out


def fmt_seconds(x) -> str:
    return "-" if x is None else f"{x:.3f}s"


# ---------------------------------------------------------------------- targets and outputs
def _find(records, phase, mode, priority):
    for r in records:
        if r["phase"] == phase and r["mode"] == mode and r["priority"] == priority:
            return r
    return None


def evaluate(records) -> list:
    targets = []
    hf, hq = _find(records, "open_loop", "flow", "high"), _find(records, "open_loop", "fifo", "high")
    if hf and hq and hf["p99_s"] and hq["p99_s"]:
        ratio = hf["p99_s"] / hq["p99_s"]
        targets.append({"target": "high-priority p99 <= 0.3x FIFO", "value": ratio, "met": ratio <= 0.3,
                        "detail": f"flow {hf['p99_s']:.3f}s vs fifo {hq['p99_s']:.3f}s = {ratio:.2f}x"})
    sat = [r for r in records if r["phase"] == "saturated" and r["mode"] == "flow"]
    if sat and sat[0].get("link_rate_bytes_per_s"):
        frac = sat[0]["goodput_bytes_per_s"] / sat[0]["link_rate_bytes_per_s"]
        targets.append({"target": "goodput >= 90% of the shaped link rate (flow, backlogged)", "value": frac,
                        "met": frac >= 0.9, "detail": f"{sat[0]['goodput_bytes_per_s'] / 1e6:.2f} MB/s of "
                                                      f"{sat[0]['link_rate_bytes_per_s'] / 1e6:.2f} MB/s = {frac:.1%}"})
    lost = sum(r["lost"] for r in records if not r.get("aggregate"))
    targets.append({"target": "no transfer lost", "value": lost, "met": lost == 0,
                    "detail": f"{lost} lost or corrupted"})
    flow, plain = _find(records, "raw_loopback", "flow", "low"), _find(records, "raw_loopback", "plain_grpc", "all")
    if flow and plain and plain["goodput_bytes_per_s"]:
        ratio = flow["goodput_bytes_per_s"] / plain["goodput_bytes_per_s"]
        targets.append({"target": "raw loopback throughput >= 0.9x plain gRPC", "value": ratio, "met": ratio >= 0.9,
                        "detail": f"ciuicflow {flow['goodput_bytes_per_s'] / 1e6:.1f} MB/s vs plain gRPC "
                                  f"{plain['goodput_bytes_per_s'] / 1e6:.1f} MB/s = {ratio:.2f}x"})
    return targets


def markdown(records, summary, testbed_line, args) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"

    def mb(x):
        return "-" if x is None else f"{x / 1e6:.2f}"

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    setup = (f"Testbed: {testbed_line}. {args.raw_requests} requests of {args.raw_tokens} tokens at once, "
             f"{BYTES_PER_TOKEN:,} bytes per token (DeepSeek-V3: 61 layers x 576 x bf16), sent per layer."
             if args.raw_only else None)
    lines = [
        "# KV-flow benchmark",
        "",
        setup or f"Testbed: {testbed_line}. Load: {args.load:.0%} of {args.rate_bps / 1e6:g} Mbit/s "
        f"({args.rate_bps / 8e6:.2f} MB/s), {args.duration:g} s of open-loop arrivals per mode; high priority "
        f"{args.high_tokens} tokens ({args.high_share:.0%} of bytes), low {args.low_tokens} tokens; "
        f"{BYTES_PER_TOKEN:,} bytes per token (DeepSeek-V3: 61 layers x 576 x bf16), sent per layer. "
        "Latency: arrival to last layer at the decode client; TTFL: to first layer. p99 is nearest-rank "
        "(the maximum below 100 samples).",
        "",
        "| phase | mode | class | n | lost | p50 ms | p99 ms | max ms | TTFL p50 ms | TTFL p99 ms | TTFL max ms "
        "| goodput MB/s | of link | link MB/s | link util. |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['phase']} | {r['mode']} | {r['priority']} | {r.get('requests', '-')} | {r['lost']} | "
            f"{ms(r.get('p50_s'))} | {ms(r.get('p99_s'))} | {ms(r.get('max_s'))} | {ms(r.get('ttfl_p50_s'))} | "
            f"{ms(r.get('ttfl_p99_s'))} | {ms(r.get('ttfl_max_s'))} | {mb(r['goodput_bytes_per_s'])} | "
            f"{pct(r.get('goodput_fraction_of_link'))} | {mb(r.get('link_bytes_per_s'))} | "
            f"{pct(r.get('link_utilisation'))} |")
    if any(r["phase"] == "raw_loopback" for r in records):
        lines += ["", "Raw loopback rows: best of the repetitions (goodput = payload bytes / time from issuing "
                  "all requests at once until the receiving process holds them all; ciuicflow's receiver also "
                  "compares every part with what was sent, as plain gRPC's server does)."]
        cpu = [f"{r['mode']} {r['cpu_s_per_gb']:.2f}" for r in records
               if r["phase"] == "raw_loopback" and r.get("cpu_s_per_gb") is not None]
        if cpu:
            lines += ["", "CPU seconds per GB delivered, all processes of the path (ciuicflow: two clients and two "
                      "sidecars; plain gRPC: client and server), lowest of the repetitions: " + ", ".join(cpu) + "."]
        busiest = [f"{r['mode']} {max(r['cpu_s_per_gb_by_process'].values()):.2f} "
                   f"({max(r['cpu_s_per_gb_by_process'], key=r['cpu_s_per_gb_by_process'].get)})"
                   for r in records if r["phase"] == "raw_loopback" and r.get("cpu_s_per_gb_by_process")]
        if busiest:
            lines += ["", "Busiest single process of each path, CPU s/GB (on two shared cores the sum above decides "
                      "the rate; with a core per process this one would): " + ", ".join(busiest) + "."]
    lines += ["", "## Targets", ""]
    for t in summary:
        lines.append(f"- {'MET' if t['met'] else 'MISSED'}: {t['target']} - {t['detail']}")
    return "\n".join(lines) + "\n"


def chart(records, path: str, testbed_line: str, load: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = {"flow": "tab:green", "fifo": "tab:red"}
    styles = {"high": "-", "low": "--"}
    for r in records:
        if r["phase"] != "open_loop" or r["priority"] == "all" or not r.get("latencies_s"):
            continue
        lat = r["latencies_s"]
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        ax1.step(lat, ys, where="post", color=colors[r["mode"]], linestyle=styles.get(r["priority"], ":"),
                 label=f"{r['mode']} / {r['priority']}")
    ax1.set_xscale("log")
    ax1.set_xlabel("transfer latency, s (log)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("open loop: latency CDF per class")
    ax1.legend()
    ax1.grid(alpha=0.3)
    labels, flow_vals, fifo_vals = [], [], []
    for priority in ("high", "low"):
        for metric, name in (("p50_s", "p50"), ("p99_s", "p99"), ("ttfl_p99_s", "TTFL p99")):
            f = _find(records, "open_loop", "flow", priority)
            q = _find(records, "open_loop", "fifo", priority)
            if f and q:
                labels.append(f"{priority}\n{name}")
                flow_vals.append((f.get(metric) or 0) * 1e3)
                fifo_vals.append((q.get(metric) or 0) * 1e3)
    x = range(len(labels))
    ax2.bar([i - 0.2 for i in x], flow_vals, 0.4, color=colors["flow"], label="flow (x-ciuic-flow: enabled)")
    ax2.bar([i + 0.2 for i in x], fifo_vals, 0.4, color=colors["fifo"], label="fifo")
    ax2.set_xticks(list(x), labels)
    ax2.set_ylabel("ms")
    ax2.set_title("open loop: latency per class")
    ax2.legend()
    ax2.grid(alpha=0.3, axis="y")
    shaped = "NOT tc-shaped" not in testbed_line
    fig.suptitle(f"KV-flow: DeepSeek-V3 KV transfers at {load:.0%} load over "
                 + ("a tc-shaped link between two namespaces" if shaped else
                    "loopback, NOT tc-shaped (link emulated by --link-rate)"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(args, records, summary, testbed_line) -> None:
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(records, fh, indent=1)
    stem = os.path.splitext(os.path.basename(args.json))[0]
    with open(os.path.join(args.out_dir, f"{stem}_targets.json"), "w") as fh:
        json.dump({"testbed": testbed_line, "targets": summary}, fh, indent=1)
    table = markdown(records, summary, testbed_line, args)
    with open(os.path.join(args.out_dir, f"{stem}.md"), "w") as fh:
        fh.write(table)
    print(table)
    if not args.no_png:
        chart(records, os.path.join(args.out_dir, f"{stem}.png"), testbed_line, args.load)
