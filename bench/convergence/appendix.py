"""The results appendix of docs/convergence.md, written from runs of bench/convergence.

    python -m bench.convergence.appendix RUN_DIR [RUN_DIR ...] --out docs/convergence-results.md

Each RUN_DIR is an --out-dir of bench/convergence (or of bench/convergence/report.py): its
convergence.json, or for a run still going its records.jsonl. Runs of several shapes (nodes x ranks
per node) and of several seed batches merge into one page: per task, one row per method and shape
with the value, exact's value, the gap, whether it is within the line (1 point of accuracy, 2% of
loss; judged on the mean over the seeds, as bench/convergence/report.py judges), the inter-node
bytes per step and their ratio to exact's. The header names the command, date, machine and commit
of every run (its run.json). A run older than run.json names its shape in convergence.md's config
line; one that names it nowhere is given as RUN_DIR=NODESxRANKS (for instance out/c=4x1).

The page depends only on the runs' files: the same runs give the same bytes, and their order on the
command line changes nothing but the command quoted in the header.

``--earlier FILE`` (bench/results/convergence/earlier.json) carries the rows of runs whose record
files are gone, as the page then printed them: marked *, listed apart in the header, and dropped
where the runs given hold the same task, method and shape at every seed the earlier row had.
The runs themselves live beside it (bench/results/convergence/<run>/), so that the page can be
written again from the repository alone.

``--replacing RUN_DIR`` (repeatable) names a rerun after a method changed: its records replace those
of the same task, shape, method and seed in the other runs (exact's included, should it hold them),
and the header says how many each replaced. Without it two finished runs that differ are an error.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from bench.convergence import report

# judged by the line; the other non-exact rows are references shown beside them (PyTorch's hook,
# an uncompressed hierarchical all-reduce, FSDP2's own HSDP)
REFERENCES = ("torch_powerSGD", "hierarchical_allreduce", "fsdp_hsdp")
_SHAPE = re.compile(r"^(\d+)x(\d+)$")


class Run:
    def __init__(self, path: str, shape: tuple[int, int] | None = None, replacing: bool = False):
        self.path = path.rstrip("/")
        self.replacing = replacing  # its records replace the other runs' (``merge``)
        self.replaced = 0
        self.meta = _metadata(self.path)
        self.source, records = _read_records(self.path)
        if shape is None and "nodes" in self.meta and "ranks_per_node" in self.meta:
            shape = (int(self.meta["nodes"]), int(self.meta["ranks_per_node"]))
        self.records = []
        for r in records:
            r_shape = (int(r["nodes"]), int(r["ranks_per_node"])) if "nodes" in r else shape
            if r_shape is None:
                raise SystemExit(f"{path}: no shape in its records, run.json or convergence.md; "
                                 f"give it as {path}=NODESxRANKS")
            self.records.append(dict(r, shape=r_shape))
        self.shapes = sorted({r["shape"] for r in self.records}, key=_shape_order)


def _shape_order(shape):
    nodes, ranks = shape
    return nodes * ranks, -ranks     # 2 x 2, 4 x 1, 3 x 2: by world size, then fewer nodes


def _metadata(path: str) -> dict:
    """run.json, else the config line bench/convergence wrote atop convergence.md before
    run.json existed."""
    run_json = os.path.join(path, "run.json")
    if os.path.exists(run_json):
        with open(run_json) as f:
            return json.load(f)
    md = os.path.join(path, "convergence.md")
    if os.path.exists(md):
        with open(md) as f:
            first = f.readline()
        if first.startswith("config: "):
            return json.loads(first[len("config: "):])
    return {}


def _read_records(path: str) -> tuple[str, list[dict]]:
    for name in ("convergence.json", "records.jsonl"):
        p = os.path.join(path, name)
        if os.path.exists(p):
            with open(p) as f:
                if name.endswith(".json"):
                    return name, json.load(f)
                return name, [json.loads(line) for line in f if line.strip()]
    raise SystemExit(f"{path}: neither convergence.json nor records.jsonl")


class Earlier:
    """Rows of a page whose runs' record files are gone: per row its task, method, shape, seeds
    and the page's cells from value to past warm-up; the header lines of those runs; PyTorch's
    smallest-rank lines per task."""

    def __init__(self, path: str):
        with open(path) as f:
            data = json.load(f)
        self.path, self.source, self.runs = path, data["from"], data["runs"]
        self.rows = [dict(r, shape=tuple(r["shape"]), earlier=True) for r in data["rows"]]
        self.smallest = data.get("smallest_torch_rank", {})

    def rows_not_in(self, rows: list[dict]) -> list[dict]:
        """The earlier rows that no row of ``rows`` (from runs at hand) covers: the same task,
        method and shape at every seed the earlier row had."""
        have = {}
        for r in rows:
            have.setdefault((r["task"], r["method"], r["shape"]), set()).update(r["seeds"])
        return [r for r in self.rows
                if not set(r["seeds"]) <= have.get((r["task"], r["method"], r["shape"]), set())]


def _earlier_miss(row: dict) -> bool:
    line = row["cells"][3]
    return ("MISS" in line or "FAILED" in line) and "(reference)" not in line


def parse_run_arg(arg: str, replacing: bool = False) -> Run:
    path, _, shape = arg.rpartition("=")
    match = _SHAPE.match(shape) if path else None
    if match:
        return Run(path, (int(match[1]), int(match[2])), replacing)
    return Run(arg, replacing=replacing)


def merge(runs: list[Run]) -> dict:
    """{(task, shape, method, seed): record}, each with its gap against the exact run of the same
    shape, task and seed, from whichever directory holds it. A run in two directories is kept
    once where both ended on the same value and bytes (runs are deterministic: a second batch of
    methods repeats exact's run), or where one of them failed (the other is its rerun); where two
    finished runs differ it is an error, not a silent pick of one, unless the later is a
    ``replacing`` run (read after the others)."""
    merged, origin = {}, {}
    for run in sorted(runs, key=lambda run: run.replacing):
        run.replaced = 0
        for r in run.records:
            key = (r["task"], r["shape"], r["method"], r.get("seed", 0))
            if key in merged and run.replacing and not origin[key].replacing:
                if not r.get("failed"):
                    merged[key], origin[key] = r, run
                    run.replaced += 1
                continue
            if key in merged:
                if _same_run(merged[key], r) or r.get("failed"):
                    continue        # the same run again, or a failed run beside its rerun
                if not merged[key].get("failed"):
                    raise SystemExit(f"{run.path}: {key} is in {origin[key].path} too, with "
                                     "another result")
            merged[key], origin[key] = r, run
    out = {}
    for shape in sorted({key[1] for key in merged}):
        for r in report.compare([r for key, r in merged.items() if key[1] == shape]):
            out[(r["task"], shape, r["method"], r.get("seed", 0))] = r
    return out


def _same_run(a: dict, b: dict) -> bool:
    return not a.get("failed") and not b.get("failed") and a["value"] == b["value"] and \
        a["inter_node_bytes_per_step"] == b["inter_node_bytes_per_step"]


def _gap(metric: str, gap: float, relative_gap: float | None) -> float | None:
    """The gap as the docs write it: accuracy in points, the method's minus exact's (below exact is
    negative); a loss in % of exact's, the method's minus exact's (above exact is positive)."""
    if metric == "accuracy":
        return -gap * 100
    return None if relative_gap is None else relative_gap * 100


def _fmt_gap(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    value = round(value, 2) + 0.0      # no "-0.00"
    return f"{value:+.2f} pt" if metric == "accuracy" else f"{value:+.2f}%"


def _fmt_shape(shape) -> str:
    return f"{shape[0]} x {shape[1]}"


def summarise(merged: dict) -> list[dict]:
    """One row per task, shape and method: means over its seeds, and the line judged on the mean
    gap (report.meets_target)."""
    groups: dict[tuple, list[dict]] = {}
    for (task, shape, method, seed), r in merged.items():
        groups.setdefault((task, shape, method), []).append(r)
    rows = []
    for (task, shape, method), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.get("seed", 0))
        ok = [r for r in rs if not r.get("failed")]
        row = {"task": task, "shape": shape, "method": method,
               "seeds": [r.get("seed", 0) for r in rs],
               "failed": [r.get("seed", 0) for r in rs if r.get("failed")],
               "metric": ok[0]["metric"] if ok else None}
        if ok:
            n = len(ok)
            row["value"] = sum(r["value"] for r in ok) / n
            row["bytes"] = sum(r["inter_node_bytes_per_step"] for r in ok) / n
            ratios = [r.get("compression_ratio") for r in ok]
            if None not in ratios:   # the state's own figure past warm-up, as the docs quote it
                row["compression_ratio"] = sum(ratios) / n
        compared = [r for r in ok if "gap" in r]
        if ok and len(compared) == len(ok) and method != report.EXACT:
            n = len(compared)
            rel = [r["relative_gap"] for r in compared]
            judged = {"metric": row["metric"], "gap": sum(r["gap"] for r in compared) / n,
                      "relative_gap": None if None in rel else sum(rel) / n}
            row["exact_value"] = sum(r["exact_value"] for r in compared) / n
            row["exact_bytes"] = sum(r["exact_inter_node_bytes_per_step"] for r in compared) / n
            row["gap"] = _gap(row["metric"], judged["gap"], judged["relative_gap"])
            row["seed_gaps"] = [_gap(row["metric"], r["gap"], r["relative_gap"])
                                for r in compared]
            row["within"] = None if row["failed"] else report.meets_target(judged)
        elif ok and method == report.EXACT:
            row["exact_value"], row["exact_bytes"] = row["value"], row["bytes"]
        rows.append(row)
    return rows


def _method_order(method: str):
    base = method.split("@")[0]
    return (method != report.EXACT, base in REFERENCES, method)


def _line_text(row: dict) -> str:
    if row["method"] == report.EXACT:
        return "baseline"
    if row["failed"]:
        return "FAILED (seed " + ", ".join(map(str, row["failed"])) + ")"
    if row.get("within") is None:
        return "no exact run"
    text = "within" if row["within"] else "**MISS**"
    return f"{text} (reference)" if row["method"].split("@")[0] in REFERENCES else text


def _row_line(row: dict, several_seeds: bool) -> str:
    if row.get("earlier"):
        return "| " + " | ".join([f"`{row['method']}`", _fmt_shape(row["shape"]),
                                  ",".join(map(str, row["seeds"])) + "*", *row["cells"]]) + " |"
    metric = row["metric"]
    value = "-" if "value" not in row else f"{row['value']:.4f}"
    exact = "-" if "exact_value" not in row else f"{row['exact_value']:.4f}"
    gap = "-"
    if "gap" in row:
        gap = _fmt_gap(metric, row["gap"])
        if len(row["seed_gaps"]) > 1:
            gap += " (" + " / ".join(_fmt_gap(metric, g) for g in row["seed_gaps"]) + ")"
    nbytes = "-" if "bytes" not in row else report._fmt_bytes(row["bytes"])
    ratio = "-"
    if row.get("exact_bytes") and row.get("bytes"):
        ratio = f"1/{row['exact_bytes'] / row['bytes']:.1f}"
    past = "-" if "compression_ratio" not in row else f"{row['compression_ratio']:.1f}x"
    cells = [f"`{row['method']}`", _fmt_shape(row["shape"])]
    if several_seeds:
        cells.append(",".join(map(str, row["seeds"])))
    cells += [value, exact, gap, _line_text(row), nbytes, ratio, past]
    return "| " + " | ".join(cells) + " |"


def _task_info(name: str):
    """The task's definition today (held out or tuned, what it trains); None if it was removed."""
    try:
        from bench.convergence import tasks
    except ImportError:
        return None
    return tasks.TASKS.get(name)


def _task_order(names):
    try:
        from bench.convergence import tasks
        order = list(tasks.TASKS)
    except ImportError:
        order = []
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def _run_line(run: Run) -> str:
    meta = run.meta
    shapes = ", ".join(_fmt_shape(s) for s in run.shapes)
    seeds = sorted({r.get("seed", 0) for r in run.records})
    parts = [f"`{run.path}` ({shapes} ranks; seeds {', '.join(map(str, seeds))})"]
    if "command" in meta:
        parts.append(f"`{meta['command']}`")
        facts = [meta.get("started"), meta.get("machine"),
                 meta.get("torch") and f"torch {meta['torch']}",
                 meta.get("commit") and f"commit {meta['commit']}"]
        parts.append(", ".join(f for f in facts if f))
    elif "merged" in meta:
        parts.append("merged by bench/convergence/report.py from " +
                     ", ".join(f"`{p}`" for p in meta["merged"]))
    else:
        parts.append("command, date and machine not recorded (a run older than run.json)")
    if run.source == "records.jsonl":
        parts.append("read from records.jsonl: the run had not finished")
    if run.replacing:
        parts.append(f"replaces {run.replaced} record(s) of the other runs (`--replacing`)")
    return "- " + ": ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else "")


def keep_methods(runs: list[Run], methods: list[str]) -> None:
    """Only ``methods``' records (and exact's, their baseline) stay in ``runs``; a method no run
    holds is an error, not an empty page."""
    found = {r["method"] for run in runs for r in run.records}
    missing = sorted(set(methods) - found)
    if missing:
        raise SystemExit(f"no run holds {missing}; the runs hold {sorted(found)}")
    for run in runs:
        run.records = [r for r in run.records if r["method"] == "exact" or r["method"] in methods]


def render(runs: list[Run], command: str, earlier: Earlier | None = None) -> str:
    merged = merge(runs)
    rows = summarise(merged)
    carried = earlier.rows_not_in(rows) if earlier else []
    runs = sorted(runs, key=lambda r: ([_shape_order(s) for s in r.shapes], r.path))
    lines = ["# Convergence results", "",
             f"Written by `{command}` from the runs of `bench/convergence` below; do not edit by "
             "hand (docs/convergence.md says what the suite is and how to read this page).", ""]
    lines += [_run_line(run) for run in runs]
    if carried:
        lines += ["", f"Earlier runs, their rows marked * after the seeds and kept as the page "
                  f"printed them (`{earlier.path}`: {earlier.source}):", ""]
        lines += ["- " + line for line in earlier.runs]
    lines += ["", "Each row: a method on one shape (nodes x ranks per node, gloo on 127.0.0.1), against "
              "the exact run of the same shape, task and seed. Value, exact and gap are means over "
              "the seeds run (per seed in brackets). Gap: accuracy in points, the method's minus exact's "
              "(below exact is negative); loss in % of exact's (above exact is positive). The line: "
              "within 1 point of exact accuracy, within 2% of exact loss, judged on the mean gap over "
              "the seeds. Bytes: modelled inter-node bytes per step and rank, warm-up included; "
              "\"vs exact\" is the share of exact's; \"past warm-up\": the state's compression_ratio, x fewer "
              "bytes than float32 after warm-up (none for exact and PyTorch's hook). References (PyTorch's `powerSGD_hook`, "
              "`hierarchical_allreduce`, FSDP2's HSDP) are shown against the line but not held to it.",
              ""]
    tasks = _task_order(sorted({r["task"] for r in rows + carried}))
    misses = [r for r in rows if r["method"] != report.EXACT and
              r["method"].split("@")[0] not in REFERENCES and (r.get("within") is False or r["failed"])]
    misses += [r for r in carried if _earlier_miss(r)]
    if misses:
        lines.append("Misses and failures:")
        lines.append("")
        for r in sorted(misses, key=lambda r: (tasks.index(r["task"]), _shape_order(r["shape"]),
                                               _method_order(r["method"]))):
            if r.get("earlier"):
                gap = r["cells"][2].split(" (")[0]
                lines.append(f"- {r['task']} `{r['method']}` on {_fmt_shape(r['shape'])}: "
                             f"{r['cells'][3].replace('**', '')}, {gap} (earlier run)")
                continue
            lines.append(f"- {r['task']} `{r['method']}` on {_fmt_shape(r['shape'])}: "
                         f"{_line_text(r).replace('**', '')}"
                         + (f", {_fmt_gap(r['metric'], r['gap'])}" if "gap" in r else ""))
    else:
        lines.append("Every judged method within its line.")
    coverage = coverage_lines(rows + carried)
    if len(coverage) > 2:
        lines += ["", "Coverage: per method at its default state and shape, the tasks run (a task "
                  "counts at 3+ seeds when its mean is over three), whether every mean is within "
                  "the line, and the mean closest to it (its seeds in brackets).", ""] + coverage
    for task in tasks:
        info = _task_info(task)
        task_rows = sorted((r for r in rows + carried if r["task"] == task),
                           key=lambda r: (_method_order(r["method"]), _shape_order(r["shape"]),
                                          bool(r.get("earlier"))))
        metric = next((r["metric"] for r in task_rows if r.get("metric")),
                      info.metric if info is not None else "?")
        held = "" if info is None else (" (held out)" if info.heldout else " (tuned)")
        lines += ["", f"## {task}{held}", ""]
        about = f"{info.note}; " if info is not None and info.note else \
            ("not in bench/convergence/tasks.py today; " if info is None else "")
        lines += [f"{about}metric: {metric}.", ""]
        several = any(len(r["seeds"]) > 1 or r.get("earlier") for r in task_rows)
        header = ["method", "shape"] + (["seeds"] if several else []) + \
            ["value", "exact", "gap", "line", "bytes/step", "vs exact", "past warm-up"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join(["---", "---"] + (["---"] if several else []) +
                                    ["---:", "---:", "---:", "---", "---:", "---:", "---:"]) + "|")
        lines += [_row_line(r, several) for r in task_rows]
        smallest = _smallest_torch_rank_lines([r for r in task_rows if not r.get("earlier")])
        if earlier:
            shapes = {line.split(", the smallest")[0] for line in smallest}
            smallest += [line + " *" for line in earlier.smallest.get(task, [])
                         if line.split(", the smallest")[0] not in shapes]
        if smallest:
            lines += [""] + smallest
    return "\n".join(lines) + "\n"


OPTIMIZERS = ("onebit_adam", "zero_one_adam")   # they replace Adam: only Adam-family tasks


def _judged(row: dict):
    """(gap as the page writes it, is it points of accuracy, within the line) of a row, earlier
    rows read back from their cells; None where the row has no judged gap."""
    if row.get("earlier"):
        gap, line = row["cells"][2].split(" (")[0], row["cells"][3]
        if gap == "-" or not ("within" in line or "MISS" in line):
            return None
        return float(gap.replace(" pt", "").rstrip("%")), gap.endswith("pt"), "within" in line
    if row.get("within") is None:
        return None
    return row["gap"], row["metric"] == "accuracy", row["within"]


def _share_of_line(gap: float, points: bool) -> float:
    """How much of the line a gap uses (1: on it; negative: better than exact)."""
    return -gap / 1.0 if points else gap / 2.0


def coverage_lines(rows: list[dict]) -> list[str]:
    """Per default-state method (no ``@`` options, no reference; DiLoCo's coverage is
    docs/diloco.md's) and shape: on how many of the tasks it applies to it has run at 3 seeds or
    more and at fewer, whether every mean is within, and the mean closest to the line. Where a task
    has several rows of one method and shape (runs and earlier rows), the one with more seeds
    counts."""
    try:
        from bench.convergence import tasks
        suite = tasks.TASKS
    except ImportError:
        suite = {}
    best: dict[tuple, dict] = {}
    for r in rows:
        m = r["method"]
        if m == report.EXACT or "@" in m or m.startswith("diloco") or m in REFERENCES:
            continue
        judged = _judged(r)
        if judged is None:
            continue
        key = (m, r["shape"], r["task"])
        if key not in best or len(r["seeds"]) > len(best[key]["seeds"]):
            best[key] = dict(r, judged=judged)
    lines = ["| method | shape | tasks at 3+ seeds | at 1-2 seeds | not run (of) | every mean within | "
             "closest to the line |", "|---|---|---:|---:|---:|---|---|"]
    for method, shape in sorted({k[:2] for k in best},
                                key=lambda k: (_method_order(k[0]), _shape_order(k[1]))):
        mine = [r for k, r in best.items() if k[:2] == (method, shape)]
        applies = [t for t, spec in suite.items()
                   if method not in OPTIMIZERS or getattr(spec, "adam_family", True)]
        three = sum(len(r["seeds"]) >= 3 for r in mine)
        closest = max(mine, key=lambda r: _share_of_line(*r["judged"][:2]))
        gap, points, _ = closest["judged"]
        misses = [r["task"] for r in mine if not r["judged"][2]]
        lines.append(f"| `{method}` | {_fmt_shape(shape)} | {three} | {len(mine) - three} | "
                     f"{len(set(applies) - {r['task'] for r in mine})} ({len(applies)}) | "
                     + ("yes" if not misses else "**no**: " + ", ".join(sorted(misses)))
                     + f" | {closest['task']} {_fmt_gap('accuracy' if points else 'loss', gap)} "
                     f"({','.join(map(str, closest['seeds']))}) |")
    return lines


def _smallest_torch_rank_lines(task_rows: list[dict]) -> list[str]:
    """Per shape, PyTorch's powerSGD_hook at the smallest rank of bench/convergence/torch_rank.py's
    search that is within the line, with its bytes (and the ranks below it that were not)."""
    by_shape: dict[tuple, list[tuple[int, dict]]] = {}
    for r in task_rows:
        rank = report.torch_rank_of(r["method"])
        if rank is not None and r.get("within") is not None:
            by_shape.setdefault(r["shape"], []).append((rank, r))
    lines = []
    for shape in sorted(by_shape, key=_shape_order):
        tried = sorted(by_shape[shape], key=lambda t: t[0])
        within = [(rank, r) for rank, r in tried if r["within"]]
        head = f"PyTorch's `powerSGD_hook` on {_fmt_shape(shape)}, the smallest rank within the line: "
        if not within:
            lines.append(head + "none of ranks " + ", ".join(str(k) for k, _ in tried) + ".")
            continue
        rank, r = within[0]
        below = [str(k) for k, _ in tried if k < rank]
        ratio = f", 1/{r['exact_bytes'] / r['bytes']:.1f} of exact's" if r.get("bytes") else ""
        lines.append(head + f"**rank {rank}**, {report._fmt_bytes(r['bytes'])} per step{ratio} "
                     f"(gap {_fmt_gap(r['metric'], r['gap'])}, seeds "
                     f"{','.join(map(str, r['seeds']))})"
                     + (f"; rank{'s' if len(below) > 1 else ''} {', '.join(below)} outside it."
                        if below else "."))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("runs", nargs="*", metavar="RUN_DIR",
                   help="an --out-dir of bench/convergence; RUN_DIR=NxR names a shape it lacks")
    p.add_argument("--out", required=True, help="the markdown page to write")
    p.add_argument("--replacing", action="append", default=[], metavar="RUN_DIR",
                   help="a rerun whose records replace the other runs' of the same task, shape, "
                   "method and seed (repeatable)")
    p.add_argument("--earlier", metavar="FILE",
                   help="rows of runs whose record files are gone (bench/results/convergence/"
                   "earlier.json), carried where the runs given do not cover them")
    p.add_argument("--methods", default="",
                   help="comma-separated: only these methods' rows (and exact's, their baseline); "
                   "default every method the runs hold")
    args = p.parse_args(argv)
    if not args.runs and not args.replacing and not args.earlier:
        p.error("no runs: give RUN_DIRs, --replacing or --earlier")
    runs = [parse_run_arg(a) for a in args.runs] + \
        [parse_run_arg(a, replacing=True) for a in args.replacing]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods:
        keep_methods(runs, methods)
    command = ("python -m bench.convergence.appendix " + " ".join(args.runs)
               + "".join(f" --replacing {a}" for a in args.replacing)
               + (f" --earlier {args.earlier}" if args.earlier else "")
               + (f" --methods {args.methods}" if methods else "") + f" --out {args.out}")
    earlier = Earlier(args.earlier) if args.earlier else None
    if earlier and methods:
        earlier.rows = [r for r in earlier.rows if r["method"] in methods + ["exact"]]
    text = render(runs, command, earlier)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"[convergence_appendix] {args.out}: {len(runs)} run(s), "
          f"{text.count(chr(10))} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
