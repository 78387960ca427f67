"""PyTorch's ``powerSGD_hook`` at the smallest rank that stays within the line, per task: the
reference issue 49 asks every method's bytes to be reported beside.

    python -m bench.convergence.torch_rank --tasks mlp_sgd_constant,charlm_adamw --seeds 0,1,2 \\
        --out-dir out/torch_rank [--baseline out/c2x2 ...]

For each task, ranks are tried in ascending order (``--ranks``, default 1,2,4,8,16,32,64): every
seed runs ``torch_powerSGD@rank=R`` and the mean gap over the seeds is judged against the line
(report.meets_target: 1 point of accuracy, 2% of loss); the search stops at the first rank within
it. Exact's run of a seed comes from a ``--baseline`` run directory of the same shape when one holds
it (runs are deterministic), else it is run here first. Writes records.jsonl, convergence.json and
run.json as bench/convergence does (so bench/convergence/appendix.py reads the directory: it shows
the smallest rank within the line under each task), and torch_rank.json: per task, the ranks tried,
their mean gaps and bytes, and the smallest within (null when none of them was).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from bench.convergence import report
from bench.convergence.__main__ import (_records, head_commit, parse_seeds, run_metadata, run_task,
                                        select_tasks, write_run_json)
from bench.convergence.report import torch_rank_method

DEFAULT_RANKS = (1, 2, 4, 8, 16, 32, 64)
PROGRAM = "bench.convergence.torch_rank"


def judge(records: list[dict], task: str, method: str, seeds: list[int]) -> dict | None:
    """The mean over ``seeds`` of ``method``'s runs on ``task`` against exact's runs of the same
    seeds ({"gap", "relative_gap", "metric", "bytes", "within"}); None unless every seed has both
    runs and none failed."""
    compared = {r.get("seed", 0): r for r in report.compare(records)
                if r["task"] == task and r["method"] == method and "gap" in r}
    if sorted(compared) != sorted(seeds):
        return None
    rs = [compared[s] for s in seeds]
    rel = [r["relative_gap"] for r in rs]
    mean = {"metric": rs[0]["metric"], "gap": sum(r["gap"] for r in rs) / len(rs),
            "relative_gap": None if None in rel else sum(rel) / len(rs),
            "bytes": sum(r["inter_node_bytes_per_step"] for r in rs) / len(rs),
            "exact_bytes": sum(r["exact_inter_node_bytes_per_step"] for r in rs) / len(rs)}
    mean["within"] = report.meets_target(mean)
    return mean


def baseline_exact(dirs: list[str], nodes: int, ranks_per_node: int) -> list[dict]:
    """Exact's records of this shape from other runs of bench/convergence."""
    from bench.convergence.appendix import Run
    found = []
    for d in dirs:
        for r in Run(d).records:
            if r["method"] == report.EXACT and not r.get("failed") and \
                    r["shape"] == (nodes, ranks_per_node):
                found.append({k: v for k, v in r.items() if k != "shape"})
    return found


def search(task, seeds, ranks, nodes, ranks_per_node, raw, baseline, steps=None,
           log=print) -> dict:
    """Ranks in ascending order until one is within the line; what each gave."""
    def records():
        own = _records(raw)
        have = {(r["task"], r.get("seed", 0)) for r in own if r["method"] == report.EXACT}
        return own + [r for r in baseline if (r["task"], r.get("seed", 0)) not in have]

    tried, smallest = [], None
    for rank in ranks:
        method = torch_rank_method(rank)
        for seed in seeds:
            have = {r["method"] for r in records() if r["task"] == task.name and
                    r.get("seed", 0) == seed and not r.get("failed")}
            todo = [m for m in (report.EXACT, method) if m not in have]
            if todo:
                run_task(task, todo, nodes, ranks_per_node, raw, steps=steps, seed=seed)
        result = judge(records(), task.name, method, seeds)
        if result is None:
            log(f"[torch_rank] {task.name}: rank {rank} failed on a seed; stopping")
            tried.append({"rank": rank, "failed": True})
            break
        tried.append(dict(result, rank=rank))
        gap = f"{-100 * result['gap']:+.2f} points" if result["metric"] == "accuracy" else \
            (f"{100 * result['relative_gap']:+.2f}% of loss" if result["relative_gap"] is not None
             else f"{result['gap']:+.4f}")
        log(f"[torch_rank] {task.name}: rank {rank}: mean gap {gap} "
            f"({'within' if result['within'] else 'outside'} the line), "
            f"{result['bytes'] / 1e3:.1f} KB/step")
        if result["within"]:
            smallest = rank
            break
    return {"task": task.name, "seeds": seeds, "tried": tried, "smallest_rank_within": smallest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convergence.torch_rank",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--tasks", help="comma-separated task names, 'tuned' or 'heldout' (default: all)")
    p.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                   help="ranks to try, ascending")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--seeds", help="comma-separated seeds (the line is judged on their mean gap)")
    p.add_argument("--baseline", action="append", default=[], metavar="RUN_DIR",
                   help="a bench/convergence --out-dir whose exact runs of this shape are reused")
    p.add_argument("--steps", type=int, help="override every task's steps (tests)")
    p.add_argument("--out-dir", default="out/torch_rank")
    args = p.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise SystemExit(f"--ranks takes comma-separated integers, got {args.ranks!r}") from None
    if not ranks or any(r < 1 for r in ranks) or ranks != sorted(set(ranks)):
        raise SystemExit(f"--ranks must be distinct positive integers in ascending order: {ranks}")
    seeds = parse_seeds(args)
    started, commit = datetime.datetime.now(datetime.timezone.utc), head_commit()
    start = time.monotonic()
    os.makedirs(args.out_dir, exist_ok=True)
    raw = os.path.join(args.out_dir, "records.jsonl")
    if os.path.exists(raw):
        os.remove(raw)
    argv = sys.argv[1:] if argv is None else argv
    config = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "seeds": seeds,
              "ranks": ranks, "baseline": args.baseline, "steps_override": args.steps,
              "seconds": None}
    write_run_json(args.out_dir, run_metadata(argv, config, started, commit, PROGRAM))
    baseline = baseline_exact(args.baseline, args.nodes, args.ranks_per_node)
    results = [search(task, seeds, ranks, args.nodes, args.ranks_per_node, raw, baseline,
                      steps=args.steps) for task in select_tasks(args.tasks)]
    records = [dict(r, nodes=args.nodes, ranks_per_node=args.ranks_per_node)
               for r in report.compare(_records(raw))]
    with open(os.path.join(args.out_dir, "convergence.json"), "w") as f:
        json.dump(records, f, indent=1)
    with open(os.path.join(args.out_dir, "torch_rank.json"), "w") as f:
        json.dump({"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "ranks": ranks,
                   "tasks": results}, f, indent=1)
    config["seconds"] = round(time.monotonic() - start, 1)
    write_run_json(args.out_dir, run_metadata(argv, config, started, commit, PROGRAM))
    for r in results:
        print(f"{r['task']}: smallest rank within the line: {r['smallest_rank_within']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
