"""``ciuicflow report RUN_DIR``: charts and a summary from a run recorded by ``Monitor``.

Draws, into ``RUN_DIR/report`` (or ``--out``):

- ``traffic_matrix.png``: bytes rank r sent to rank p over the run, a heatmap (the split across
  peers is modelled from per-link-class bytes, see ``ciuicflow.monitor.traffic``);
- ``comm_fraction.png``: each rank's share of step time in communication, step by step
  (a rolling mean when runs are long);
- ``step_times.png``: the distribution of step times, pooled and per rank;

and prints a summary (step-time percentiles, slowest rank, bytes per link class, compression,
error-feedback norm, alerts, the monitor's own overhead). ``--json PATH`` writes the summary.
Works offline: it reads only the run directory.
"""
from __future__ import annotations

import json
import os
import sys

CHARTS = ("traffic_matrix.png", "comm_fraction.png", "step_times.png")


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="directory written by "
                        "ciuicflow.monitor.Monitor(run_dir=...)")
    parser.add_argument("--out", metavar="DIR", help="where the PNGs go (default RUN_DIR/report)")
    parser.add_argument("--skip", type=int, default=0, metavar="N",
                        help="leave each rank's first N steps out (warm-up, bucket rebuild)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    parser.add_argument("--no-charts", action="store_true", help="print the summary only")


def run(args) -> int:
    from ciuicflow.monitor.recorder import load_run

    if args.skip < 0:
        print("ciuicflow report: error: --skip must be >= 0", file=sys.stderr)
        return 2
    try:
        recorded = load_run(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ciuicflow report: error: {exc}", file=sys.stderr)
        return 2
    steps = {rank: records[args.skip:] for rank, records in recorded.steps.items()}
    if not any(steps.values()):
        print(f"ciuicflow report: error: {args.run_dir} holds no steps"
              f"{' after --skip ' + str(args.skip) if args.skip else ''}", file=sys.stderr)
        return 2
    summary = summarize(recorded, steps)
    if not args.no_charts:
        out_dir = args.out or os.path.join(args.run_dir, "report")
        os.makedirs(out_dir, exist_ok=True)
        summary["charts"] = draw_charts(recorded, steps, out_dir)
    print(format_summary(summary))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2)
    return 0


# ------------------------------------------------------------------------------------------------
# Figures


def _percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def _total(records: list[dict], key: str) -> float:
    return float(sum(r.get(key) or 0.0 for r in records))


def rank_totals(recorded, steps) -> tuple[list[float], list[float]]:
    """Per rank (0..world-1) bytes sent intra-node and inter-node over the kept steps."""
    world = recorded.world_size
    intra = [_total(steps.get(r, []), "intra_node_bytes") for r in range(world)]
    inter = [_total(steps.get(r, []), "inter_node_bytes") for r in range(world)]
    return intra, inter


def summarize(recorded, steps: dict[int, list[dict]]) -> dict:
    node_of_rank = recorded.node_of_rank
    all_step_s = [r["step_s"] for records in steps.values() for r in records]
    per_rank = []
    for rank in recorded.ranks:
        records = steps.get(rank, [])
        meta = recorded.metas[rank]
        sent = _total(records, "intra_node_bytes") + _total(records, "inter_node_bytes")
        exact = _total(records, "exact_intra_node_bytes") + _total(records, "exact_inter_node_bytes")
        inter = _total(records, "inter_node_bytes")
        norms = [r["error_feedback_norm"] for r in records if r.get("error_feedback_norm") is not None]
        end = recorded.ends.get(rank, {})
        step_total = _total(records, "step_s")
        per_rank.append({
            "rank": rank, "node": node_of_rank[rank], "host": meta.get("host"),
            "steps": len(records),
            "median_step_s": _percentile([r["step_s"] for r in records], 50) if records else None,
            "mean_busy_s": _total(records, "compute_s") / len(records) if records else None,
            "comm_fraction": _total(records, "comm_s") / step_total if step_total else None,
            "intra_node_bytes": _total(records, "intra_node_bytes"),
            "inter_node_bytes": inter,
            "compression_ratio": exact / sent if sent else None,
            "inter_node_compression_ratio":
                _total(records, "exact_inter_node_bytes") / inter if inter else None,
            "last_error_feedback_norm": norms[-1] if norms else None,
            "monitor_overhead_fraction":
                end["overhead_s"] / _total(recorded.steps[rank], "step_s")
                if end.get("overhead_s") is not None and recorded.steps[rank] else None,
        })
    with_steps = [p for p in per_rank if p["steps"]]
    slowest = max(with_steps, key=lambda p: p["median_step_s"])
    busiest = max(with_steps, key=lambda p: p["mean_busy_s"])
    total_steps = sum(p["steps"] for p in per_rank)
    sent_all = sum(p["intra_node_bytes"] + p["inter_node_bytes"] for p in per_rank)
    exact_all = sum(_total(r, "exact_intra_node_bytes") + _total(r, "exact_inter_node_bytes")
                    for r in steps.values())
    inter_all = sum(p["inter_node_bytes"] for p in per_rank)
    exact_inter_all = sum(_total(r, "exact_inter_node_bytes") for r in steps.values())
    fractions = [p["comm_fraction"] for p in with_steps if p["comm_fraction"] is not None]
    return {
        "run_dir": recorded.run_dir, "run_id": recorded.run_id,
        "world_size": recorded.world_size, "ranks_recorded": len(recorded.ranks),
        "nodes": recorded.num_nodes, "traffic_model": recorded.traffic_model,
        "sources": sorted({s for m in recorded.metas.values() for s in m.get("sources", [])}),
        "steps_per_rank": {str(p["rank"]): p["steps"] for p in per_rank},
        "step_s": {"median": _percentile(all_step_s, 50), "p90": _percentile(all_step_s, 90),
                   "p99": _percentile(all_step_s, 99), "mean": sum(all_step_s) / len(all_step_s),
                   "max": max(all_step_s)},
        "slowest_rank": {k: slowest[k] for k in ("rank", "node", "host", "median_step_s")},
        "busiest_rank": {k: busiest[k] for k in ("rank", "node", "host", "mean_busy_s")},
        "comm_fraction": {"median": _percentile(fractions, 50) if fractions else None,
                          "min": min(fractions) if fractions else None,
                          "max": max(fractions) if fractions else None},
        "bytes_per_step": {
            "intra_node": sum(p["intra_node_bytes"] for p in per_rank) / total_steps,
            "inter_node": inter_all / total_steps},
        "compression_ratio": exact_all / sent_all if sent_all else None,
        "inter_node_compression_ratio": exact_inter_all / inter_all if inter_all else None,
        "alerts": {"straggler": sum(a["kind"] == "straggler" for a in recorded.alerts),
                   "hang": sum(a["kind"] == "hang" for a in recorded.alerts),
                   "items": recorded.alerts},
        "per_rank": per_rank,
    }


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def format_summary(s: dict) -> str:
    from ciuicflow.monitor.stragglers import describe_hang, describe_straggler

    lines = [
        f"run {s['run_dir']} ({s['run_id'][:8]}): {s['ranks_recorded']} of {s['world_size']} "
        f"ranks recorded on {s['nodes']} node(s); sources: {', '.join(s['sources']) or 'none'}",
        f"step time (all ranks): median {_ms(s['step_s']['median'])}, p90 "
        f"{_ms(s['step_s']['p90'])}, p99 {_ms(s['step_s']['p99'])}, max {_ms(s['step_s']['max'])}",
        f"slowest rank: {s['slowest_rank']['rank']} (node {s['slowest_rank']['node']}, "
        f"{s['slowest_rank']['host']}), median {_ms(s['slowest_rank']['median_step_s'])}; "
        f"busiest outside communication: rank {s['busiest_rank']['rank']} "
        f"({_ms(s['busiest_rank']['mean_busy_s'])}/step)",
        f"communication share of step time: median {_pct(s['comm_fraction']['median'])} "
        f"(ranks from {_pct(s['comm_fraction']['min'])} to {_pct(s['comm_fraction']['max'])})",
        f"bytes sent per rank and step: intra-node {_bytes(s['bytes_per_step']['intra_node'])}, "
        f"inter-node {_bytes(s['bytes_per_step']['inter_node'])}; compression "
        f"{_ratio(s['compression_ratio'])} (all links), "
        f"{_ratio(s['inter_node_compression_ratio'])} (inter-node)",
        "",
        f"{'rank':>4} {'node':>4} {'steps':>6} {'median step':>12} {'busy/step':>10} {'comm':>6} "
        f"{'intra-node':>11} {'inter-node':>11} {'ratio':>7} {'EF norm':>9} {'monitor':>8}",
    ]
    for p in s["per_rank"]:
        norm = p["last_error_feedback_norm"]
        lines.append(
            f"{p['rank']:>4} {p['node']:>4} {p['steps']:>6} {_ms(p['median_step_s']):>12} "
            f"{_ms(p['mean_busy_s']):>10} {_pct(p['comm_fraction']):>6} "
            f"{_bytes(p['intra_node_bytes']):>11} {_bytes(p['inter_node_bytes']):>11} "
            f"{_ratio(p['compression_ratio']):>7} {('-' if norm is None else f'{norm:.3g}'):>9} "
            f"{_pct(p['monitor_overhead_fraction']):>8}")
    alerts = s["alerts"]
    lines += ["", f"alerts: {alerts['straggler']} straggler, {alerts['hang']} hang"]
    for alert in alerts["items"]:
        describe = describe_hang if alert["kind"] == "hang" else describe_straggler
        lines.append("  " + describe(alert))
    if s.get("charts"):
        lines += ["", "charts: " + ", ".join(s["charts"])]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Charts


def draw_charts(recorded, steps, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    paths = [os.path.join(out_dir, name) for name in CHARTS]
    draw_traffic_matrix(recorded, steps, paths[0])
    draw_comm_fraction(recorded, steps, paths[1])
    draw_step_times(recorded, steps, paths[2])
    return paths


def _byte_unit(maximum: float) -> tuple[str, float]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if maximum >= scale:
            return unit, scale
    return "B", 1.0


def draw_traffic_matrix(recorded, steps, path: str) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    from ciuicflow.monitor.traffic import traffic_matrix

    intra, inter = rank_totals(recorded, steps)
    problem = None
    try:
        matrix = np.asarray(traffic_matrix(recorded.node_of_rank, intra, inter,
                                           recorded.traffic_model))
    except ValueError as exc:  # bytes on a link class with no peers: say so, draw nothing
        problem = str(exc)
        matrix = np.zeros((recorded.world_size, recorded.world_size))
    unit, scale = _byte_unit(float(matrix.max()))
    world = recorded.world_size
    size = min(4 + 0.4 * world, 14)
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(matrix / scale, cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"{unit} sent over the run")
    if world <= 16:
        top = matrix.max() / scale
        for r in range(world):
            for p in range(world):
                value = matrix[r, p] / scale
                if value:
                    ax.text(p, r, f"{value:.3g}", ha="center", va="center", fontsize=8,
                            color="black" if value > 0.6 * top else "white")
    # node boundaries
    for r in range(1, world):
        if recorded.node_of_rank[r] != recorded.node_of_rank[r - 1]:
            ax.axhline(r - 0.5, color="red", linewidth=1)
            ax.axvline(r - 0.5, color="red", linewidth=1)
    ax.set_xlabel("to rank")
    ax.set_ylabel("from rank")
    ticks = range(world) if world <= 32 else range(0, world, max(1, world // 16))
    ax.set_xticks(list(ticks))
    ax.set_yticks(list(ticks))
    ax.set_title(f"traffic matrix ({recorded.traffic_model} model, {recorded.num_nodes} "
                 f"node(s); red lines: node boundaries)")
    if problem:
        ax.set_xlabel("to rank\n(not drawn: " + problem[:90] + ")", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smoothed(records: list[dict], window: int):
    """(steps, comm fraction in %) with a rolling mean over ``window`` steps (fewer if short)."""
    import numpy as np

    window = max(1, min(window, len(records)))
    values = np.asarray([r["comm_fraction"] for r in records], dtype=float) * 100
    smoothed = np.convolve(values, np.ones(window) / window, mode="valid")
    return [r["step"] for r in records][window - 1:], smoothed


def draw_comm_fraction(recorded, steps, path: str) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    longest = max(len(r) for r in steps.values())
    window = max(1, longest // 50)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ranks = [r for r in recorded.ranks if steps.get(r)]
    if len(ranks) <= 16:
        for rank in ranks:
            x, y = _smoothed(steps[rank], window)
            ax.plot(x, y, label=f"rank {rank} (node {recorded.node_of_rank[rank]})")
        ax.legend(fontsize=8, ncol=2 if len(ranks) > 8 else 1)
    else:  # too many lines to read: median and range over ranks, over the steps all ranks have
        length = min(len(steps[r]) for r in ranks)
        curves = [_smoothed(steps[r][:length], window) for r in ranks]
        x = curves[0][0]
        data = np.array([y for _, y in curves])
        ax.fill_between(x, data.min(0), data.max(0), alpha=0.3, label="min-max over ranks")
        ax.plot(x, np.median(data, 0), label="median over ranks")
        ax.legend(fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_xlabel("step")
    ax.set_ylabel("communication, % of step time")
    title = "communication fraction per rank"
    ax.set_title(title + (f" (rolling mean over {window} steps)" if window > 1 else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_step_times(recorded, steps, path: str) -> None:
    import matplotlib.pyplot as plt

    ranks = [r for r in recorded.ranks if steps.get(r)]
    pooled = [s["step_s"] * 1e3 for r in ranks for s in steps[r]]
    fig, (hist, box) = plt.subplots(1, 2, figsize=(12, 4.5),
                                    gridspec_kw={"width_ratios": [1, 1.4]})
    hist.hist(pooled, bins=min(50, max(10, len(pooled) // 10)), color="tab:blue", alpha=0.8)
    for q, style in ((50, "-"), (90, "--"), (99, ":")):
        value = _percentile(pooled, q)
        hist.axvline(value, color="black", linestyle=style, label=f"p{q} {value:.1f} ms")
    hist.set_xlabel("step time (ms)")
    hist.set_ylabel("steps")
    hist.set_title("all ranks")
    hist.legend(fontsize=8)
    box.boxplot([[s["step_s"] * 1e3 for s in steps[r]] for r in ranks], showfliers=True)
    box.set_xticks(range(1, len(ranks) + 1))
    box.set_xticklabels([str(r) for r in ranks], fontsize=8 if len(ranks) <= 32 else 5)
    box.set_xlabel("rank")
    box.set_ylabel("step time (ms)")
    box.set_title("per rank")
    box.grid(alpha=0.3, axis="y")
    fig.suptitle("step-time distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
