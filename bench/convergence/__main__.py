"""Convergence suite: does compression keep accuracy? Every task of bench/convergence/tasks.py is
trained to completion with exact all-reduce, every ciuicflow hook with its default state, PyTorch's
powerSGD_hook at the same rank, and (Adam tasks) ciuicflow's 1-bit optimizers against exact Adam,
on simulated nodes (torchrun's variables, gloo on 127.0.0.1), same seeds and batches for all.

    python -m bench.convergence                      # the whole suite, 2 nodes x 2 ranks
    python -m bench.convergence --smoke              # CI: every method on every task but one, 12 steps
    python -m bench.convergence --tasks mlp_sgd_constant --methods exact,hierarchical_1bit
    python -m bench.convergence --fsdp               # the FSDP path (ciuicflow.fsdp) on every task
    python -m bench.convergence --tasks heldout      # only the held-out tasks
    python -m bench.convergence --seeds 0,1,2        # each run three times; the means beside them

Writes JSON (a list of records: task, method, metric, value, exact_value, gap,
inter_node_bytes_per_step, curve, ...), a markdown table and a PNG of the curves under --out-dir.
``--check-targets`` exits 1 when a compressed method misses the target: within 1 point of exact
accuracy, within 2% of exact loss/MSE. With ``--seeds`` every seed's run is judged against the
exact run of the same seed (a miss on any seed is a miss; the comparison with PyTorch's
``powerSGD_hook`` is judged on the means over the seeds), and the table of means over the seeds
(``seeds.json``, and in the markdown) says how a method does beyond one run's noise: on some
tasks two exact runs that differ only in summation order end 2 points apart (docs/history/convergence-notebook.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
from bench.convergence import tasks
from bench.convergence.report import check_targets, compare, write_outputs

WORKER = ["-m", "bench.convergence.worker"]


def default_methods(task, fsdp: bool = False) -> list[str]:
    from ciuicflow.ddp.hooks import HOOKS
    from bench.convergence.report import FSDP_HOOKS

    if fsdp:  # the FSDP path: FSDP2's own HSDP and ciuicflow.fsdp's compressing methods
        return ["exact", "fsdp_hsdp", *FSDP_HOOKS]
    methods = ["exact", *HOOKS, "torch_powerSGD"]
    if task.adam_family:
        methods += ["onebit_adam", "zero_one_adam"]
    return methods


def _free_port() -> int:
    from ciuicflow.kvflow.sidecar.process import free_port
    return free_port()


def run_task(task, methods, nodes, ranks_per_node, out_path, steps=None, timeout=1800, seed=0):
    """Run the task's methods in one job of nodes x ranks processes; a method that crashes the job
    is recorded as failed and the job restarts with the methods after it."""
    remaining = list(methods)
    while remaining:
        done_before = _finished(out_path, task.name, seed)
        world = nodes * ranks_per_node
        port = _free_port()
        procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % ranks_per_node),
                       LOCAL_WORLD_SIZE=str(ranks_per_node), GROUP_RANK=str(rank // ranks_per_node),
                       GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
            cmd = [sys.executable, *WORKER, "--task", task.name, "--methods", ",".join(remaining),
                   "--out", out_path, "--seed", str(seed)] + (["--steps", str(steps)] if steps else [])
            procs.append(subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else
                                          subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout
        errors = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                _, err = proc.communicate()
                err = (err or "") + "\n(timed out)"
            if proc.returncode:
                errors.append(err)
                for other in procs:  # one rank failing leaves the others blocked in a collective
                    if other.poll() is None:
                        other.kill()
        finished = _finished(out_path, task.name, seed) - done_before
        remaining = [m for m in remaining if m not in finished]
        if not errors:
            return
        failed = remaining.pop(0) if remaining else None
        if failed is not None and failed not in _failed(out_path, task.name, seed):
            with open(out_path, "a") as f:
                f.write(json.dumps({"task": task.name, "method": failed, "failed": True,
                                    "seed": seed, "error": (errors[0] or "")[-2000:]}) + "\n")
        print(f"[convergence] {task.name}: {failed} failed\n{(errors[0] or '')[-1500:]}",
              file=sys.stderr, flush=True)


def _records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished(path, task_name, seed):
    return {r["method"] for r in _records(path)
            if r["task"] == task_name and r.get("seed", 0) == seed}


def _failed(path, task_name, seed):
    return {r["method"] for r in _records(path)
            if r["task"] == task_name and r.get("seed", 0) == seed and r.get("failed")}


def parse_seeds(args) -> list[int]:
    """``--seeds 0,1,2`` (distinct integers) or ``--seed N``."""
    if args.seeds is None:
        return [0 if args.seed is None else args.seed]
    if args.seed is not None:
        raise SystemExit("give --seed or --seeds, not both")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds repeats a seed: {args.seeds!r}")
    return seeds


# Left out of ``--smoke`` unless named: the suite's slowest steps on CPU (bf16 autocast of the largest
# transformer, 75 of the smoke's 200 s of training in CI, and of the MoE model), whose paths
# charlm_adamw (a transformer under Adam) and three bf16 tasks (one under Adam) smoke already
# (PowerSGD's stacked experts: tests/compression/test_powersgd_experts.py).
SMOKE_SKIPS = ("charlm_adam_bf16", "moe_lm_adamw_bf16")


def select_tasks(spec: str | None, smoke: bool = False):
    suite = list(tasks.TASKS.values())
    if not spec:
        return [t for t in suite if t.name not in SMOKE_SKIPS] if smoke else suite
    if spec in ("tuned", "heldout"):
        return [t for t in suite if t.heldout == (spec == "heldout")]
    unknown = [n for n in spec.split(",") if n not in tasks.TASKS]
    if unknown:
        raise SystemExit(f"unknown task(s) {unknown}; choose from {sorted(tasks.TASKS)}")
    return [tasks.TASKS[n] for n in spec.split(",")]


def head_commit() -> str | None:
    """The checkout's commit, read when a run starts (the code it runs)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_metadata(argv: list[str], config: dict, started: datetime.datetime, commit: str | None,
                 program: str = "bench.convergence") -> dict:
    """What produced a run, beside its records (run.json): bench/convergence/appendix.py's header
    names the command, date, machine and commit of every table it writes."""
    import torch
    return {"command": f"python -m {program}" + "".join(" " + shlex.quote(a) for a in argv),
            "argv": list(argv), "started": started.isoformat(timespec="seconds"),
            "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "torch": torch.__version__, "commit": commit,
            **config}


def write_run_json(out_dir: str, meta: dict) -> None:
    """run.json: written when a run starts (``seconds`` None: a run cut short keeps its command)
    and again when it ends."""
    with open(os.path.join(out_dir, "run.json"), "w") as f:
        json.dump(meta, f, indent=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tasks", help="comma-separated task names, 'tuned' or 'heldout' (default: all)")
    p.add_argument("--methods", help="comma-separated methods (default: all that apply to a task)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--smoke", action="store_true",
                   help="every method for 12 steps (2 past the warm-up), on every task but "
                   f"{', '.join(SMOKE_SKIPS)} unless --tasks names it (CI)")
    p.add_argument("--fsdp", action="store_true",
                   help="the FSDP path instead of DDP's: exact DDP, FSDP2's HSDP and every fsdp:<method>")
    p.add_argument("--steps", type=int, help="override every task's steps")
    p.add_argument("--seed", type=int, default=None,
                   help="initial weights and batch order (the data stay the same; default 0)")
    p.add_argument("--seeds", help="comma-separated seeds: every run once per seed, judged against "
                   "the exact run of its seed, and the means over seeds reported beside")
    p.add_argument("--json", metavar="PATH", help="JSON output (default OUT_DIR/convergence.json)")
    p.add_argument("--out-dir", default="out/convergence")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--check-targets", action="store_true", help="exit 1 if a target is missed")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    started, commit = datetime.datetime.now(datetime.timezone.utc), head_commit()
    steps = args.steps or (12 if args.smoke else None)
    os.makedirs(args.out_dir, exist_ok=True)
    raw = os.path.join(args.out_dir, "records.jsonl")
    if os.path.exists(raw):
        os.remove(raw)
    seeds = parse_seeds(args)
    json_path = args.json or os.path.join(args.out_dir, "convergence.json")
    run_dir = os.path.dirname(os.path.abspath(json_path))
    argv = sys.argv[1:] if argv is None else argv
    config = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "smoke": args.smoke,
              "steps_override": steps, "seeds": seeds, "seconds": None, "fsdp": args.fsdp}
    os.makedirs(run_dir, exist_ok=True)
    write_run_json(run_dir, run_metadata(argv, config, started, commit))
    start = time.monotonic()
    for task in select_tasks(args.tasks, args.smoke):
        methods = args.methods.split(",") if args.methods else default_methods(task, args.fsdp)
        if not task.adam_family:
            methods = [m for m in methods if m.split("@")[0] not in ("onebit_adam", "zero_one_adam")]
        print(f"[convergence] {task.name}: {task.note}; methods {', '.join(methods)}", flush=True)
        for seed in seeds:
            if len(seeds) > 1:
                print(f"[convergence] {task.name}: seed {seed}", flush=True)
            run_task(task, methods, args.nodes, args.ranks_per_node, raw, steps=steps, seed=seed)
    # each record names its shape, so runs of several shapes merge (bench/convergence/appendix.py)
    records = [dict(r, nodes=args.nodes, ranks_per_node=args.ranks_per_node)
               for r in compare(_records(raw))]
    config["seconds"] = round(time.monotonic() - start, 1)
    table = write_outputs(records, json_path, args.out_dir, png=not args.no_png,
                          config={k: v for k, v in config.items() if k != "fsdp"})
    write_run_json(run_dir, run_metadata(argv, config, started, commit))
    print(table)
    failed = [r for r in records if r.get("failed")]
    if failed:
        print(f"[convergence] FAILED: {[(r['task'], r['method']) for r in failed]}", file=sys.stderr)
        return 1
    if args.check_targets and not args.smoke:
        missed = check_targets(records)
        for line in missed:
            print(f"[convergence] target missed: {line}", file=sys.stderr)
        return 1 if missed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
