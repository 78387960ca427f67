"""Loss (or accuracy) against inter-node bytes per step: the frontier of DiLoCo beside the synchronous methods,
from bench/convergence's records (``convergence.json`` or ``records.jsonl``; several files merge).

    python -m bench.convergence.frontier out/convergence/convergence.json --out-dir out/frontier
    python -m bench.convergence.frontier a/records.jsonl b/records.jsonl --out-dir out/frontier --no-png

A task, method and seed found in several files counts once, from the last file naming it (list reruns last).

For each task (the mean over the seeds every method of it ran on), every method is a point (bytes one rank sends
to other nodes per step, final metric). A family's frontier is its best metric at or below a number of bytes:
``synchronous`` (exact DDP, the hooks, PyTorch's PowerSGD, the 1-bit optimizers) and ``diloco`` (every
``diloco`` or ``diloco_*`` row). "Where they meet": at each synchronous method's bytes, DiLoCo's frontier there (its best row
sending no more) against that method's metric: ``ahead`` (DiLoCo better), ``behind``, or ``no DiLoCo row`` that
cheap. Writes frontier.json (points and comparisons), frontier.md, and frontier.png (matplotlib, if installed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench.convergence import diloco_methods


def load(paths: list[str]) -> list[dict]:
    """The finished records of ``paths``; a task, method and seed run in several files counts once:
    the last file's (a rerun replaces what it reruns; averaged, one seed would count twice)."""
    kept: dict[tuple, dict] = {}
    for path in paths:
        with open(path) as f:
            if path.endswith(".jsonl"):
                records = [json.loads(line) for line in f if line.strip()]
            else:
                records = json.load(f)
        for r in records:
            if not r.get("failed") and r.get("value") is not None \
                    and r.get("inter_node_bytes_per_step") is not None:
                kept[(r["task"], r["method"], r.get("seed", 0))] = r
    return list(kept.values())


def family(method: str) -> str:
    return "diloco" if diloco_methods.is_diloco(method.partition("@")[0]) else "synchronous"


def points(records: list[dict]) -> dict[str, list[dict]]:
    """Per task: one point per method, the mean over the seeds on which every method of the task ran."""
    by_task: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        by_task.setdefault(r["task"], {}).setdefault(r["method"], []).append(r)
    out = {}
    for task, methods in by_task.items():
        seeds = None
        for rs in methods.values():
            s = {r.get("seed", 0) for r in rs}
            seeds = s if seeds is None else seeds & s
        rows = []
        for method, rs in methods.items():
            rs = [r for r in rs if r.get("seed", 0) in seeds]
            if not rs:
                continue
            n = len(rs)
            rows.append({"task": task, "method": method, "family": family(method), "metric": rs[0]["metric"],
                         "seeds": sorted(r.get("seed", 0) for r in rs),
                         "value": sum(r["value"] for r in rs) / n,
                         "bytes": sum(r["inter_node_bytes_per_step"] for r in rs) / n})
        out[task] = sorted(rows, key=lambda p: p["bytes"])
    return out


def better(metric: str, a: float, b: float) -> bool:
    return a > b if metric == "accuracy" else a < b


def frontier(rows: list[dict], fam: str) -> list[dict]:
    """The family's Pareto points, by bytes: each better than every cheaper one."""
    best, out = None, []
    for p in sorted((p for p in rows if p["family"] == fam), key=lambda p: p["bytes"]):
        if best is None or better(p["metric"], p["value"], best):
            best = p["value"]
            out.append(p)
    return out


def best_at(rows: list[dict], fam: str, max_bytes: float) -> dict | None:
    cheap = [p for p in rows if p["family"] == fam and p["bytes"] <= max_bytes]
    if not cheap:
        return None
    key = (lambda p: -p["value"]) if cheap[0]["metric"] == "accuracy" else (lambda p: p["value"])
    return min(cheap, key=key)


def compare(rows: list[dict]) -> list[dict]:
    """At each synchronous method's bytes (exact DDP's included), DiLoCo's best row sending no more."""
    out = []
    for s in (p for p in rows if p["family"] == "synchronous"):
        d = best_at(rows, "diloco", s["bytes"])
        verdict = "no DiLoCo row" if d is None else \
            "ahead" if better(s["metric"], d["value"], s["value"]) else \
            "equal" if d["value"] == s["value"] else "behind"
        out.append({"task": s["task"], "synchronous": s["method"], "sync_value": s["value"],
                    "sync_bytes": s["bytes"], "diloco": d and d["method"], "diloco_value": d and d["value"],
                    "diloco_bytes": d and d["bytes"], "verdict": verdict})
    return out


def _kb(b: float) -> str:
    return f"{b / 1e3:.1f} KB"


def markdown(by_task: dict, comparisons: list[dict]) -> str:
    lines = []
    for task, rows in by_task.items():
        seeds = sorted({s for p in rows for s in p["seeds"]})
        metric = rows[0]["metric"]
        lines += [f"### {task} ({metric}, {'higher' if metric == 'accuracy' else 'lower'} is better; "
                  f"seeds {', '.join(map(str, seeds))})", "",
                  "| method | family | inter-node bytes/step | value | on its family's frontier |",
                  "|---|---|---:|---:|:---:|"]
        fronts = {f: {p["method"] for p in frontier(rows, f)} for f in ("synchronous", "diloco")}
        for p in rows:
            lines.append(f"| {p['method']} | {p['family']} | {_kb(p['bytes'])} | {p['value']:.4f} | "
                         f"{'yes' if p['method'] in fronts[p['family']] else ''} |")
        lines += ["", "| synchronous method | its bytes | its value | DiLoCo's best at <= those bytes | "
                  "its bytes | its value | DiLoCo |", "|---|---:|---:|---|---:|---:|:---:|"]
        for c in (c for c in comparisons if c["task"] == task):
            none = c["diloco"] is None
            d, db = ("-", "") if none else (c["diloco"], _kb(c["diloco_bytes"]))
            dv = "" if none else f"{c['diloco_value']:.4f}"
            lines.append(f"| {c['synchronous']} | {_kb(c['sync_bytes'])} | {c['sync_value']:.4f} | {d} | "
                         f"{db} | {dv} | {c['verdict']} |")
        lines.append("")
    return "\n".join(lines)


def plot(by_task: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(by_task)
    cols = min(3, len(tasks))
    nrows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.0 * nrows), squeeze=False)
    style = {"synchronous": ("s", "#4c72b0"), "diloco": ("o", "#dd8452")}
    for ax, task in zip(axes.flat, tasks):
        rows = by_task[task]
        for fam, (marker, color) in style.items():
            pts = [p for p in rows if p["family"] == fam]
            if not pts:
                continue
            ax.scatter([p["bytes"] for p in pts], [p["value"] for p in pts], marker=marker, color=color,
                       label=fam, s=22, zorder=3)
            front = frontier(rows, fam)
            right = max(p["bytes"] for p in rows)  # the frontier holds its best to the right
            ax.step([p["bytes"] for p in front] + [right], [p["value"] for p in front] + [front[-1]["value"]],
                    where="post", color=color, lw=1.2, alpha=0.8)
            for p in pts:
                ax.annotate(p["method"].replace("hierarchical_", "h_"), (p["bytes"], p["value"]), fontsize=5.5,
                            alpha=0.8, xytext=(2, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("inter-node bytes per step per rank (log)")
        ax.set_ylabel(rows[0]["metric"])
        ax.set_title(task, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("records", nargs="+", help="convergence.json or records.jsonl files")
    p.add_argument("--out-dir", default="out/frontier")
    p.add_argument("--no-png", action="store_true")
    args = p.parse_args(argv)
    by_task = points(load(args.records))
    if not by_task:
        print("no records with a value and bytes", file=sys.stderr)
        return 1
    comparisons = [c for rows in by_task.values() for c in compare(rows)]
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "frontier.json"), "w") as f:
        json.dump({"points": by_task, "comparisons": comparisons}, f, indent=1)
    text = markdown(by_task, comparisons)
    with open(os.path.join(args.out_dir, "frontier.md"), "w") as f:
        f.write(text)
    outputs = ["frontier.json", "frontier.md"]
    if not args.no_png and plot(by_task, os.path.join(args.out_dir, "frontier.png")):
        outputs.append("frontier.png")
    print(text)
    print("wrote " + ", ".join(os.path.join(args.out_dir, o) for o in outputs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
