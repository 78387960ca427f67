"""DiLoCo beside the synchronous methods on the simulated multi-node cluster: step time and inter-node bytes.

Same cluster as bench/comm (network namespaces, each node's link rate limited with tc tbf; bytes read from
the links' counters), same model (an MLP), data and optimizer (Adam, or SGD with momentum: ``--optimizer``);
the synchronous rows (``allreduce``, any hook of bench/comm, the ``no_comm`` floor) run through
bench/comm/worker.py's own code, and the DiLoCo rows (``diloco``: its defaults, which follow the optimizer;
``diloco_<codec>_h<H>[_f<F>][_d<D>[_k]]``, bench/convergence/diloco_methods.py's names) train with DDP inside each
node and ``ciuicflow.DiLoCo`` across nodes (bench/diloco/worker.py). Each DiLoCo row measures a whole
number of periods H, its syncs included. Writes JSON (records), a markdown table and (optionally) a PNG.

    python -m bench.diloco                  # 25M-param MLP, 2 nodes x 2 ranks, 1 Gbit/s, 2 rounds
    python -m bench.diloco --smoke          # tiny and quick, for CI (< 60 s)
    python -m bench.diloco --methods no_comm,allreduce,diloco_int4_h8 --rounds 3
    python -m bench.diloco --optimizer sgd --lr 0.01   # the defaults under SGD (1 bit every 4 steps)

Target: at DiLoCo's default configuration, a mean step within 1.1x of ``no_comm``'s, as a
ratio of the same run's medians (the rounds are interleaved: every method, then every method again).
"""
import argparse
import os
import sys
import time

from ciuicflow.testing.cluster import SimCluster, parse_rate
from bench.common.cluster_args import add_cluster_arguments
from bench.common.launch import run_in_launches
from bench.common.report import combine_rounds, per_round_ratios, write_outputs
from bench.common.worker import OPTIMIZERS

WORKER = ["-m", "bench.diloco.worker"]


def default_diloco() -> str:
    """The method name of ciuicflow.diloco's documented default configuration."""
    from bench.convergence.diloco_methods import default_name
    return default_name()


def default_methods() -> str:
    return ",".join(["no_comm", "allreduce", "hierarchical_1bit", default_diloco(), "diloco_int4_h8_f2_d1",
                     "diloco_onebit_h2_f2_d1", "diloco_int8_h16", "diloco_exact_h8"])


SMOKE = dict(params=200_000, layers=4, batch=8, steps=8, warmup=2, rounds=1, bucket_cap_mb=0.25, timeout=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.diloco", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_cluster_arguments(p)
    p.set_defaults(steps=32)
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per method first (>= 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=1e-4, help="the optimizer's learning rate")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="adam, or sgd (momentum 0.9); DiLoCo's defaults follow it")
    p.add_argument("--methods", help="comma-separated (default: no_comm, allreduce, hierarchical_1bit, "
                   "DiLoCo's default and variants)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians reported")
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps, one round: CI")
    p.add_argument("--json", metavar="PATH", help="JSON output (default OUT_DIR/diloco_comm.json)")
    p.add_argument("--out-dir", default="out/diloco_comm")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    p.add_argument("--require-netns", action="store_true", help="fail instead of falling back to loopback")
    p.add_argument("--check-targets", action="store_true",
                   help="exit 1 if the default DiLoCo row's step is above 1.1x no_comm's")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
        if args.methods is None:
            args.methods = f"no_comm,allreduce,{default_diloco()},diloco_int8_h4_f2_d1"  # the thread path too
    args.methods = args.methods or default_methods()
    args.params = int(float(args.params))
    args.rate_bps = None if str(args.rate).lower() == "none" else parse_rate(args.rate)
    if args.warmup < 2 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup >= 2, --steps >= 1, --rounds >= 1")
    from bench.diloco.worker import check_method
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    try:
        for m in args.method_list:
            check_method(m)
    except ValueError as exc:
        p.error(str(exc))
    return args


def run_methods(cluster, args, log):
    def worker_argv(todo, out):
        return [*WORKER, "--methods", ",".join(todo), "--params", args.params, "--layers", args.layers,
                "--batch", args.batch, "--steps", args.steps, "--warmup", args.warmup,
                "--bucket-cap-mb", args.bucket_cap_mb, "--lr", args.lr, "--optimizer", args.optimizer,
                "--out", out]

    records, _ = run_in_launches(cluster, list(args.method_list) * args.rounds, worker_argv, log, args.timeout,
                                 lambda method, why: {"method": method, "failed": why})
    return records


def _resolved(record) -> str:
    """What DiLoCo's "auto" chose for this run's optimizer, e.g. " (default: onebit every 4)"."""
    stats = record.get("hook_stats") or {}
    return f" (default: {stats.get('codec', '?')} every {stats.get('sync_every', '?')})"


def ratios(records):
    """Each method's median step over no_comm's median step, and the ratio within each round."""
    by = {r["method"]: r for r in records if "step_seconds" in r}
    floor = by.get("no_comm")
    if floor is None:
        return {}
    return {m: (r["step_seconds"] / floor["step_seconds"], per_round_ratios(r, floor)) for m, r in by.items()}


def targets(records, default):
    out = []
    x = ratios(records).get(default)
    if x is not None:
        each = ", ".join(f"{v:.2f}" for v in x[1])
        out.append((f"{default} (DiLoCo's default) step is {x[0]:.2f}x no_comm (per round {each}; "
                    f"target: <= 1.1x)", x[0] <= 1.1))
    by = {r["method"]: r for r in records if "step_seconds" in r}
    base, mine = by.get("allreduce"), by.get(default)
    if base and mine and base.get("inter_node_bytes_per_step") and mine.get("inter_node_bytes_per_step"):
        fewer = base["inter_node_bytes_per_step"] / mine["inter_node_bytes_per_step"]
        out.append((f"{default} sends {fewer:.0f}x fewer inter-node bytes per step than allreduce (link "
                    f"counters; target: >= 100x)", fewer >= 100))
    return out


def markdown(records, cluster_line, config_line, default, smoke=False):
    rx = ratios(records)
    by = {r["method"]: r for r in records if "step_seconds" in r}
    base = by.get("allreduce")
    lines = [f"**Cluster:** {cluster_line}", "", f"**Run:** {config_line}", "",
             "| method | s/step (median) | x no_comm | x no_comm per round | network wait s/step | "
             "CPU s/step/rank | inter-node MB/step | fewer bytes than allreduce | final loss |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in records:
        if "step_seconds" not in r:
            lines.append(f"| {r['method']} | FAILED | | | | | | | {r.get('failed')} |")
            continue
        x, each = rx.get(r["method"], (None, []))
        b = r.get("inter_node_bytes_per_step")
        fewer = "n/a"
        if b and base and base.get("inter_node_bytes_per_step"):
            fewer = f"{base['inter_node_bytes_per_step'] / b:.0f}x"
        lines.append(
            f"| {r['method']}{_resolved(r) if r['method'] == default else ''} | {r['step_seconds']:.3f} | "
            f"{'n/a' if x is None else f'{x:.2f}'} | {', '.join(f'{v:.2f}' for v in each)} | "
            f"{r['comm_seconds']:.3f} | {r.get('cpu_seconds', float('nan')):.3f} | "
            f"{'n/a' if b is None else f'{b / 1e6:.4f}'} | {fewer} | {r['final_loss']:.5f} |")
    checks = targets(records, default)
    if checks:
        shaped = any(r.get("shaped") for r in records)
        judged = shaped and not smoke
        lines += ["", "Targets" + ("" if shaped else " - NOT SHAPED: loopback, nothing judged")
                  + (" - smoke (a tiny model, latency-bound): shown, not judged" if smoke else "") + ":", ""]
        lines += [f"- {('PASS ' if ok else 'MISS ') if judged else ''}{text}" for text, ok in checks]
    return "\n".join(lines) + "\n"


def chart(records, path, title):
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in records if "step_seconds" in r and r.get("inter_node_bytes_per_step")]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ax.scatter(r["inter_node_bytes_per_step"] / 1e6, r["step_seconds"],
                   marker="o" if r["method"].startswith("diloco") else "s")
        ax.annotate(r["method"], (r["inter_node_bytes_per_step"] / 1e6, r["step_seconds"]), fontsize=7)
    floor = {r["method"]: r for r in records if "step_seconds" in r}.get("no_comm")
    if floor:
        ax.axhline(floor["step_seconds"], color="k", ls="--", lw=1, label="no_comm floor")
        ax.axhline(1.1 * floor["step_seconds"], color="gray", ls=":", lw=1, label="1.1x no_comm")
        ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("inter-node MB per step (link counters, log)")
    ax.set_ylabel("seconds per step (median over rounds)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    default = default_diloco()
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = args.json or os.path.join(args.out_dir, "diloco_comm.json")
    started, load_before = time.monotonic(), os.getloadavg()[0]
    with SimCluster(args.nodes, args.ranks_per_node, args.rate_bps, require_netns=args.require_netns) as cluster:
        cluster_line = cluster.describe()
        records = run_methods(cluster, args, log)
    records = combine_rounds(records)
    widths = {r.get("width") for r in records if r.get("width")}
    config_line = (f"MLP {args.layers} x Linear({widths.pop() if len(widths) == 1 else '?'}) "
                   f"~{args.params / 1e6:g}M params, batch {args.batch}/rank, {args.warmup} warm-up + "
                   f"{args.steps} measured steps per method (DiLoCo: whole periods), {args.rounds} interleaved "
                   f"round(s), medians; {args.optimizer} lr {args.lr:g}; {args.nodes} nodes x {args.ranks_per_node} ranks, "
                   f"gloo; {time.monotonic() - started:.0f} s wall; load (1-min) {load_before:.1f} before, "
                   f"{os.getloadavg()[0]:.1f} after, {os.cpu_count()} CPUs")
    for r in records:
        r.update(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate_bps=args.rate_bps,
                 shaped=cluster.shaped, cluster=cluster_line, default_diloco=default)
    table = markdown(records, cluster_line, config_line, default, smoke=args.smoke)
    outputs = write_outputs(json_path, records, table, chart=None if args.no_png else lambda png: chart(
        records, png, f"{cluster_line}\n{config_line}"))
    print(table)
    if not cluster.shaped:
        print(f"WARNING: {cluster_line}")
    print("wrote " + ", ".join(outputs))
    if not any("step_seconds" in r for r in records) or any("failed" in r for r in records):
        return 1
    if args.check_targets and not args.smoke and any(not ok for _, ok in targets(records, default)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
