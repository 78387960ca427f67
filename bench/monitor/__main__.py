"""What ciuicflow.monitor costs a training step: the same DDP loop with and without monitoring, in one run.

Two (or --ranks) gloo processes on 127.0.0.1 train an MLP under DDP with the hierarchical_1bit hook
(each rank its own simulated node, so 1-bit compression and error feedback are live). Steps run in
blocks that alternate between unmonitored and monitored (off, on, off, on, ...), so slow drifts of a
shared machine hit both arms alike. The monitor is configured as it would be left on in production:
a run directory, a Prometheus endpoint per rank, a straggler check every 50 steps (a gather), the
hang watchdog, and the error-feedback norm every 50 steps (the Monitor's defaults). Its threads and endpoint exist during
the unmonitored blocks as well; they idle there, and only the per-step work differs between arms.

Reported (rank 0; a rank's steps are synchronised by DDP anyway):
- A/B overhead: for each pair of adjacent blocks, mean monitored step / mean unmonitored step - 1;
  the median over pairs, with the interquartile range as its noise band; in wall time, and in the
  main thread's CPU time (time.thread_time), which a busy shared machine disturbs far less (waiting
  for peers and the hooks' worker thread do not count in it, so its ratio errs on the high side);
- direct overhead: wall time measured inside the monitor's own calls (step_begin, phase, step_end,
  straggler gathers) as a share of monitored step time;
- the monitor alone: its calls looped in one process with nothing else to do (CPU and wall time
  per step), as a share of the unmonitored step's CPU time: the steadiest figure on a busy machine.
Target: < 2% of step time.

    python -m bench.monitor                      # ~1.3M-parameter MLP, 2 ranks, 40 blocks x 6 steps
    python -m bench.monitor --smoke --json out/monitor_overhead.json   # seconds, for CI
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

from bench.monitor.worker import rank_main


TARGET = 0.02
SMOKE = dict(hidden=128, layers=3, batch=16, blocks=6, block_steps=5, warmup=4, straggler_every=5, timeout=180)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.monitor", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576, help="MLP width (default 576)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    p.add_argument("--blocks", type=int, default=40, help="blocks of steps, alternating off/on (even)")
    p.add_argument("--block-steps", type=int, default=6, help="steps per block")
    p.add_argument("--warmup", type=int, default=12, help="unmeasured steps first (1-bit warm-up, buckets)")
    p.add_argument("--straggler-every", type=int, default=50, help="the Monitor's default (smoke: 5)")
    p.add_argument("--smoke", action="store_true", help="tiny and quick, for CI")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the markdown table to PATH")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (the monitor's gathers need peers)")
    if args.blocks < 2 or args.blocks % 2:
        p.error("--blocks must be an even number >= 2")
    if min(args.hidden, args.layers, args.batch, args.block_steps) < 1 or args.warmup < 0:
        p.error("sizes and step counts must be positive")
    return args


# ------------------------------------------------------------------------------------------------
# One rank


# ------------------------------------------------------------------------------------------------
# Launch and report


def run(args):
    import multiprocessing
    import queue

    import torch.distributed as dist

    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    results = ctx.Queue()
    run_dir = tempfile.mkdtemp(prefix="ciuicflow-monitor-overhead-")
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    processes = [ctx.Process(target=rank_main, args=(r, args.ranks, store.port, args, run_dir, results),
                             daemon=True) for r in range(args.ranks)]
    for process in processes:
        process.start()
    if env_before is None:
        os.environ.pop("OMP_NUM_THREADS")
    deadline = time.monotonic() + args.timeout
    values = {}
    try:
        while len(values) < args.ranks:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {args.timeout:.0f} s")
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in values]
                if dead and results.empty():
                    time.sleep(1.0)
                    if results.empty():
                        raise RuntimeError(f"ranks {dead} exited without a result")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            values[rank] = value
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
    isolated = isolated_cost(500 if args.smoke else 5000)
    return summarize(args, values[0], run_dir, isolated)


def _paired(off, on):
    """Median and interquartile range over block pairs of mean(on) / mean(off) - 1."""
    ratios = [statistics.fmean(b) / statistics.fmean(a) - 1 for a, b in zip(off, on)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), [quartiles[0], quartiles[2]]


def isolated_cost(steps: int) -> dict:
    """The monitor's own per-step cost with no training around it: one process, a hook state
    (untrained: its stats() still runs), a run directory and a Prometheus endpoint. No gathers and
    no heartbeat thread (one process), and no error-feedback norm (no memory yet)."""
    import ciuicflow
    from ciuicflow.monitor import Monitor

    with tempfile.TemporaryDirectory() as run_dir:
        mon = Monitor(run_dir, [ciuicflow.OneBitState()], prometheus_port=0)

        def loop(n):
            for _ in range(n):
                mon.step_begin()
                with mon.phase("forward+backward"):
                    pass
                mon.add_metrics(loss=1.0)
                mon.step_end()

        loop(min(200, steps))
        cpu, wall = time.thread_time(), time.perf_counter()
        loop(steps)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        mon.close()
    return {"cpu_us_per_step": cpu / steps * 1e6, "wall_us_per_step": wall / steps * 1e6}


def summarize(args, rank0, run_dir, isolated):
    off, on = rank0["times"]["off"], rank0["times"]["on"]
    ab, ab_iqr = _paired(off, on)
    cpu_off, cpu_on = rank0["cpu_times"]["off"], rank0["cpu_times"]["on"]
    cpu_ab, cpu_iqr = _paired(cpu_off, cpu_on)
    on_total = sum(sum(block) for block in on)
    on_steps = sum(len(block) for block in on)
    direct = (rank0["overhead_s"] + rank0["gather_s"]) / on_total
    flat_off = [t for block in off for t in block]
    flat_on = [t for block in on for t in block]
    return {
        "benchmark": "monitor_overhead", "smoke": args.smoke, "ranks": args.ranks,
        "model": {"hidden": args.hidden, "layers": args.layers, "params": rank0["params"],
                  "batch": args.batch, "hook": "hierarchical_1bit"},
        "blocks_per_arm": args.blocks // 2, "steps_per_block": args.block_steps,
        "step_s_off": {"median": statistics.median(flat_off), "mean": statistics.fmean(flat_off)},
        "step_s_on": {"median": statistics.median(flat_on), "mean": statistics.fmean(flat_on)},
        "ab_overhead": ab, "ab_overhead_iqr": ab_iqr,
        "cpu_ab_overhead": cpu_ab, "cpu_ab_overhead_iqr": cpu_iqr,
        "cpu_step_s_off": statistics.fmean(t for block in cpu_off for t in block),
        "cpu_step_s_on": statistics.fmean(t for block in cpu_on for t in block),
        "isolated_monitor_cpu_us_per_step": isolated["cpu_us_per_step"],
        "isolated_monitor_wall_us_per_step": isolated["wall_us_per_step"],
        "isolated_share_of_cpu_step": isolated["cpu_us_per_step"] * 1e-6
        / statistics.fmean(t for block in cpu_off for t in block),
        "direct_overhead": direct,
        "monitor_us_per_step": rank0["overhead_s"] / on_steps * 1e6,
        "gather_us_per_step": rank0["gather_s"] / on_steps * 1e6,
        "target": TARGET, "ab_target_met": ab < TARGET, "cpu_ab_target_met": cpu_ab < TARGET,
        "direct_target_met": direct < TARGET,
        "compression_ratio": rank0["compression_ratio"], "run_dir": run_dir,
    }


def markdown(r) -> str:
    def ms(x):
        return f"{x * 1e3:.2f} ms"

    rows = [
        ("model", f"MLP {r['model']['layers']} x {r['model']['hidden']} ({r['model']['params']:,} params), "
                  f"batch {r['model']['batch']}, {r['ranks']} ranks, {r['model']['hook']}"),
        ("blocks x steps per arm", f"{r['blocks_per_arm']} x {r['steps_per_block']}"),
        ("step time without monitor (median / mean)", f"{ms(r['step_s_off']['median'])} / {ms(r['step_s_off']['mean'])}"),
        ("step time with monitor (median / mean)", f"{ms(r['step_s_on']['median'])} / {ms(r['step_s_on']['mean'])}"),
        ("A/B overhead, wall time (median of block pairs, IQR)",
         f"{r['ab_overhead'] * 100:+.2f}% ({r['ab_overhead_iqr'][0] * 100:+.2f}% .. {r['ab_overhead_iqr'][1] * 100:+.2f}%)"),
        ("main-thread CPU per step without / with monitor",
         f"{ms(r['cpu_step_s_off'])} / {ms(r['cpu_step_s_on'])}"),
        ("A/B overhead, main-thread CPU time (median, IQR)",
         f"{r['cpu_ab_overhead'] * 100:+.2f}% ({r['cpu_ab_overhead_iqr'][0] * 100:+.2f}% .. "
         f"{r['cpu_ab_overhead_iqr'][1] * 100:+.2f}%)"),
        ("direct overhead (wall time inside the monitor's calls)", f"{r['direct_overhead'] * 100:.2f}%"),
        ("monitor alone, one process (CPU / wall per step)",
         f"{r['isolated_monitor_cpu_us_per_step']:.0f} us / {r['isolated_monitor_wall_us_per_step']:.0f} us "
         f"= {r['isolated_share_of_cpu_step'] * 100:.2f}% of the unmonitored step's CPU time"),
        ("wall time inside the monitor's calls per step", f"{r['monitor_us_per_step']:.0f} us"),
        ("straggler gathers per step (amortised)", f"{r['gather_us_per_step']:.0f} us"),
        ("target", f"< {r['target'] * 100:.0f}%: wall A/B {'met' if r['ab_target_met'] else 'MISSED'}, "
                   f"CPU A/B {'met' if r['cpu_ab_target_met'] else 'MISSED'}, "
                   f"direct {'met' if r['direct_target_met'] else 'MISSED'}"),
    ]
    lines = ["| measure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    if r["smoke"]:
        lines.append("\n(smoke run: a tiny model whose steps are so short that fixed per-step costs weigh "
                     "far more than in real training)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    table = markdown(result)
    print(table)
    for path, text in ((args.json, json.dumps(result, indent=2)), (args.markdown, table)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
