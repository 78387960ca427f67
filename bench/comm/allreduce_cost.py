"""What one compressed all-reduce costs each rank, without a model around it: CPU and wall time.

Real gloo processes on simulated nodes (``ciuicflow.testing.processes``, loopback), each reducing
the same fresh float32 tensor with a quantising compressor at its default state, as a DDP hook
would reduce one bucket. Per rank and call, after unmeasured warm-up calls: the process's CPU
seconds (steadier than wall time where ranks share cores) and the wall seconds; the table gives the
mean over ranks and calls, with the exact all-reduce of the same route measured in the same run as
the baseline. ``bench/comm`` measures whole training steps; this isolates the reduction, so a
change to it can be compared before and after (run it from either checkout).

    python -m bench.comm.allreduce_cost                     # 1-bit, hierarchical, 25M elements, 2 x 2
    python -m bench.comm.allreduce_cost --flat --compressor int4
    python -m bench.comm.allreduce_cost --phases 2           # each rank serves a segment (W > 2's default)
    python -m bench.comm.allreduce_cost --adaptive           # as under Adam: plain units and the optimizer's
    python -m bench.comm.allreduce_cost --smoke             # CI
"""
import argparse
import json
import os
import sys
import time

import torch

from ciuicflow.testing.processes import run_distributed

COMPRESSORS = ("onebit", "int8", "int4")
SMOKE = dict(numel=1 << 20, steps=2, warmup=1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--compressor", choices=COMPRESSORS, default="onebit")
    p.add_argument("--flat", action="store_true", help="compress across every rank (else hierarchical)")
    p.add_argument("--phases", choices=("auto", "1", "2"), default="auto",
                   help="the compressor's phases option (auto: its default)")
    p.add_argument("--numel", type=int, default=25_000_000, help="float32 elements per call")
    p.add_argument("--steps", type=int, default=8, help="measured calls per rank")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured calls per rank first")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--adaptive", action="store_true",
                   help="the tensor is stepped by Adam: the compressor's adaptive plan, timed in plain "
                   "units and in the optimizer's (the units rebuilt from Adam's state every call, as a "
                   "DDP hook does)")
    p.add_argument("--smoke", action="store_true", help="1M elements, few calls: CI")
    p.add_argument("--json", default="out/allreduce_cost.json")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.numel <= 0 or args.steps <= 0 or args.warmup < 0:
        p.error("--numel and --steps must be positive, --warmup not negative")
    if args.nodes <= 0 or args.ranks_per_node <= 0:
        p.error("--nodes and --ranks-per-node must be positive")
    return args


def _compressor(name, phases):
    """The compressor's default state, but for ``phases``."""
    if name == "onebit":
        from ciuicflow.compression.onebit import OneBitCompressor as cls
    elif name == "int8":
        from ciuicflow.compression.int8 import Int8Compressor as cls
    else:
        from ciuicflow.compression.int4 import Int4Compressor as cls
    return cls(phases=phases if phases == "auto" else int(phases))


def _adam_stepped(numel: int, rank: int) -> torch.nn.Parameter:
    """A parameter of ``numel`` elements that Adam has stepped a few times (its second moment set,
    and the optimizer watch told)."""
    from ciuicflow.compression import optimizer_watch

    optimizer_watch.watch()
    param = torch.nn.Parameter(torch.zeros(numel))
    adam = torch.optim.Adam([param], lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        param.grad = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen)
        adam.step()
    return param


def _calls(name, flat, phases, numel, adaptive, x, topology, rank):
    """{row: (a callable reducing ``x`` once, its compressor's memory or None, whether it passes
    the optimizer's units)}: the compressor
    (with ``adaptive``, its plan for an Adam-stepped tensor in plain units and in the optimizer's)
    and the exact reduction."""
    from ciuicflow.collectives.routes import EXACT, FlatRoute, HierarchicalRoute
    from ciuicflow.compression.base import Context
    from ciuicflow.compression.optimizer_watch import units
    from ciuicflow.compression.quantized import quantized_all_reduce

    route = (FlatRoute if flat else HierarchicalRoute)(topology)
    exact = {"exact": (lambda: route.reduce(x.view(-1), EXACT, None), None, False)}
    if not adaptive:
        compressor = _compressor(name, phases)
        memory = compressor.new_memory()
        return {name: (lambda: quantized_all_reduce(compressor, x, memory, topology,
                                                    hierarchical=not flat), memory, False),
                **exact}
    param = _adam_stepped(numel, rank)
    segments = ((0, (numel,)),)

    def row(with_units):
        compressor = _compressor(name, phases)
        memory = compressor.new_memory()

        def call():  # the units rebuilt from Adam's state every call, as the hooks do
            context = Context(segments, adaptive=True, units=units(
                [param], segments, numel, x.device) if with_units else None)
            compressor.exchange(x.view(-1), memory, route, context, None)
        return call, memory, with_units

    return {f"{name} (Adam, plain units)": row(False),
            f"{name} (Adam, optimizer's units)": row(True), **exact}


def _measure(rank, world, name, flat, phases, numel, steps, warmup, adaptive=False):
    """Per row: (CPU s, wall s) per call of this rank, the plan its last call sent and whether in
    the optimizer's units (None for the exact reduction). The rows take turns call by call, so
    that the machine's drift falls on all of them alike."""
    from ciuicflow.topology import Topology

    torch.set_num_threads(1)
    topology = Topology.detect()
    base = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    x = torch.empty(numel)
    calls = _calls(name, flat, phases, numel, adaptive, x, topology, rank)
    cpu = dict.fromkeys(calls, 0.0)
    wall = dict.fromkeys(calls, 0.0)
    for step in range(warmup + steps):
        for method, (call, _, _) in calls.items():
            x.copy_(base)
            c0, w0 = time.process_time(), time.perf_counter()
            call()
            if step >= warmup:
                cpu[method] += time.process_time() - c0
                wall[method] += time.perf_counter() - w0
    out = {}
    for method, (_, memory, with_units) in calls.items():
        plan = getattr(memory, "wire_plan", None)
        out[method] = (cpu[method] / steps, wall[method] / steps,
                       plan.summary() if plan is not None else None,
                       None if memory is None else bool(with_units and plan is not None
                                                        and plan.in_units and memory.in_units))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    world = args.nodes * args.ranks_per_node
    route = "flat" if args.flat else "hierarchical"
    print(f"[bench] {args.compressor} ({route}) and exact all-reduces of {args.numel} float32 on "
          f"{args.nodes} nodes x {args.ranks_per_node} ranks (gloo, loopback): {args.warmup} + "
          f"{args.steps} calls each", flush=True)
    started = time.perf_counter()
    per_rank = run_distributed(_measure, world, nodes=args.nodes,
                               args=(args.compressor, args.flat, args.phases, args.numel,
                                     args.steps, args.warmup, args.adaptive), timeout=1800)
    records = []
    for method in per_rank[0]:
        cpu = sum(r[method][0] for r in per_rank) / world
        wall = sum(r[method][1] for r in per_rank) / world
        records.append({"method": method, "route": route, "phases": args.phases,
                        "numel": args.numel, "adaptive": args.adaptive,
                        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                        "cpu_s_per_call_rank": cpu, "wall_s_per_call": wall,
                        "plan": per_rank[0][method][2], "in_units": per_rank[0][method][3],
                        "per_rank": [list(r[method][:2]) for r in per_rank]})
    exact = records[-1]
    lines = [f"{args.compressor} (phases {args.phases}) vs exact ({route}), {args.numel} float32, {args.nodes} x "
             f"{args.ranks_per_node} ranks, {time.perf_counter() - started:.0f} s wall", "",
             "| method | sent | CPU ms / call / rank | wall ms / call | x exact (wall) |",
             "|---|---|---:|---:|---:|"]
    for r in records:
        sent = "-" if r["plan"] is None else r["plan"] + (" (optimizer's units)" if r["in_units"] else "")
        lines.append(f"| {r['method']} | {sent} | {1e3 * r['cpu_s_per_call_rank']:.1f} | "
                     f"{1e3 * r['wall_s_per_call']:.1f} | "
                     f"{r['wall_s_per_call'] / exact['wall_s_per_call']:.2f} |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(records, f, indent=1)
    markdown = os.path.splitext(args.json)[0] + ".md"
    with open(markdown, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.json}, {markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
