"""FSDP2 with its own HSDP all-reduce vs each ciuicflow method reducing the shards across nodes, in one run.

The same MLP (bench/comm's), same data, same steps per method, on N simulated nodes whose inter-node
link is rate limited with tc (ciuicflow/testing/cluster.py, docs/cluster.md): `hsdp` (FSDP2 over the 2-D mesh),
every hierarchical method of ciuicflow's registry through `ciuicflow.fsdp.register` (FSDP2 inside the
node), `fsdp` (FSDP2 over every rank, its own reduce-scatter) and `fsdp:<method>` (the same with
ciuicflow's compressed reduce-scatter), and `no_comm` (the model alone, no FSDP and no
communication: the compute floor). Bytes on the wire come
from the links' counters. Writes JSON (one record per method), a markdown table and a PNG.
The model trains with Adam, under which a 1-bit state's default sends int4 (docs/hooks.md, "Adaptive
optimizers"): the 1-bit methods run with adaptive_optimizer='same', so each row measures its own codec
(the int4 rows measure what the 1-bit methods' defaults send under Adam).

    python -m bench.fsdp                 # 25M-param MLP, 2 nodes x 2 ranks, 1 Gbit/s
    python -m bench.fsdp --smoke         # tiny and quick, for CI
"""
import argparse
import os
import sys
import time

from ciuicflow.testing.cluster import SimCluster, parse_rate
from bench.common.cluster_args import add_cluster_arguments
from bench.common.launch import run_in_launches
from bench.common.report import step_and_bytes_chart, write_outputs
from bench.fsdp.worker import METHODS

WORKER = ["-m", "bench.fsdp.worker"]
SMOKE = dict(params="200000", steps=2, warmup=2, batch=8, probe_numel=1 << 18)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_cluster_arguments(p)
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per method first")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps: CI")
    p.add_argument("--json", metavar="PATH", help="JSON output (default OUT_DIR/fsdp.json)")
    p.add_argument("--out-dir", default="out/fsdp")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--probe-numel", type=int, default=4 << 20,
                   help="probe the machine (gloo inside the node) and compare ciuicflow plan --fsdp's "
                        "predictions with the measurements (0: skip)")
    p.add_argument("--loopback", action="store_true", help="plain loopback even as root (nothing shaped)")
    p.add_argument("--check-targets", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.params = int(float(args.params))
    args.rate_bps = None if str(args.rate).lower() == "none" else parse_rate(args.rate)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {','.join(METHODS)}")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be positive")
    return args


def run(cluster, args, log):
    """Every method, in as few torchrun launches as possible (a crash loses only its method), then
    the machine probe. Returns (records, probe or None)."""
    def worker_argv(todo, out):
        return [*WORKER, "--methods", ",".join(todo), "--params", args.params, "--layers", args.layers,
                "--batch", args.batch, "--steps", args.steps, "--warmup", args.warmup, "--lr", args.lr,
                "--out", out, "--probe-numel", args.probe_numel]

    records, probe = run_in_launches(cluster, args.method_list, worker_argv, log, args.timeout,
                                     lambda method, why: {"method": method, "failed": why})
    return records, (probe or None)


def planner_rows(records, machine):
    """ciuicflow plan --fsdp's predictions next to the run (empty without a probe or a shaped link)."""
    if not machine:
        return []
    from bench.comm.plan_calibration import calibrate_fsdp
    try:
        return calibrate_fsdp(records, machine)
    except ValueError:
        return []


def targets(records, planned=()):
    by = {r["method"]: r for r in records if "step_seconds" in r}
    out = []
    if planned:
        worst = max(planned, key=lambda row: abs(row["step_error"]))
        out.append((f"planner within 25% of every measured step time (worst: {worst['method']} "
                    f"{worst['step_error']:+.0%})", abs(worst["step_error"]) <= 0.25))
    hsdp, h1 = by.get("hsdp"), by.get("hierarchical_1bit")
    if hsdp and h1 and hsdp["inter_node_bytes_per_step"] and h1["inter_node_bytes_per_step"]:
        ratio = hsdp["inter_node_bytes_per_step"] / h1["inter_node_bytes_per_step"]
        out.append((f"hierarchical_1bit moves 1/{ratio:.1f} of HSDP's inter-node bytes (target: <= 1/25)",
                    ratio >= 25))
    if hsdp and h1:
        x = h1["step_seconds"] / hsdp["step_seconds"]
        out.append((f"hierarchical_1bit step time is {x:.2f}x HSDP's (target: below 1)", x < 1))
    return out


def markdown(records, cluster_line, config_line, planned=()):
    by = {r["method"]: r for r in records if "step_seconds" in r}
    base, floor = by.get("hsdp"), by.get("no_comm")
    lines = [f"**Cluster:** {cluster_line}", "", f"**Run:** {config_line}", "",
             "| method | s/step | x hsdp | x no_comm | ciuicflow s/step | inter-node MB/step | bytes vs hsdp "
             "| final loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if "step_seconds" not in r:
            lines.append(f"| {r['method']} | FAILED | | | | | | {r['failed'][:200]} |")
            continue
        b = r["inter_node_bytes_per_step"]
        vs = "n/a" if b is None or not base or not base["inter_node_bytes_per_step"] else \
            (f"1/{base['inter_node_bytes_per_step'] / b:.1f}" if b else "0")
        xh = f"{r['step_seconds'] / base['step_seconds']:.2f}" if base else "n/a"
        xf = f"{r['step_seconds'] / floor['step_seconds']:.2f}" if floor else "n/a"
        lines.append(f"| {r['method']} | {r['step_seconds']:.3f} | {xh} | {xf} | {r['ciuicflow_seconds']:.3f} | "
                     f"{'n/a' if b is None else f'{b / 1e6:.2f}'} | {vs} | {r['final_loss']:.5f} |")
    if planned:
        lines += ["", "`ciuicflow plan --fsdp` (alpha-beta model; latency, intra-node bandwidth through gloo, "
                  "matmul rate and compression cost probed on this machine; compute = no_comm's step):", "",
                  "| method | predicted s/step | measured | error | predicted inter-node MB | measured |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in planned:
            mb = row["measured_inter_node_bytes"]
            lines.append(f"| {row['method']} | {row['predicted_step_seconds']:.3f} | "
                         f"{row['measured_step_seconds']:.3f} | {row['step_error']:+.0%} | "
                         f"{row['predicted_inter_node_bytes'] / 1e6:.2f} | "
                         f"{'n/a' if mb is None else f'{mb / 1e6:.2f}'} |")
    checks = targets(records, planned)
    if checks:
        shaped = any(r.get("shaped") for r in records)
        lines += ["", "Targets (at 1 Gbit/s)" + ("" if shaped else " - NOT SHAPED") + ":", ""]
        lines += [f"- {'PASS' if ok else 'MISS'} {text}" for text, ok in checks]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = args.json or os.path.join(args.out_dir, "fsdp.json")
    started = time.monotonic()
    with SimCluster(args.nodes, args.ranks_per_node, args.rate_bps, loopback=args.loopback) as cluster:
        cluster_line = cluster.describe()
        records, machine = run(cluster, args, log)
    ran = [r for r in records if "step_seconds" in r]
    config_line = (f"MLP {args.layers} x Linear({ran[0]['width'] if ran else '?'}) ~{args.params / 1e6:g}M params, "
                   f"FSDP2, batch {args.batch}/rank, {args.warmup} warmup + {args.steps} measured steps/method, "
                   f"Adam lr {args.lr:g}; {args.nodes} nodes x {args.ranks_per_node} ranks, gloo; "
                   f"{time.monotonic() - started:.0f} s wall; {os.cpu_count()} CPUs")
    for r in records:
        r.update(cluster=cluster_line, shaped=cluster.shaped, rate_bps=args.rate_bps)
    planned = planner_rows(records, machine)
    for row in planned:
        next(r for r in records if r["method"] == row["method"])["planner"] = row
    table = markdown(records, cluster_line, config_line, planned)
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    outputs = write_outputs(json_path, records, table, extra_json={".probe.json": machine} if machine else None,
                            chart=None if args.no_png else lambda png: step_and_bytes_chart(
                                records, png, f"{cluster_line}\n{config_line}"))
    print(table)
    print("wrote " + ", ".join(outputs))
    if len(ran) != len(records):
        return 1
    if args.check_targets and any(not ok for _, ok in targets(records, planned)):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
