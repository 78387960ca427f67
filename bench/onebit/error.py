"""How much of a gradient 1-bit compression drops, per layer, along exact training of a task.

Trains one task of bench/convergence/tasks.py exactly in one process (the mean of the four ranks'
gradients, the task's optimizer settings and learning-rate schedule; SGD tasks only) and, at the
chosen steps, compresses rank 0's gradient of each layer (and of all parameters end to end,
"(all)") with the native 1-bit codec (scale x sign,
one scale per ``--chunk`` elements, no error memory) and reports the share of its energy lost,
||x - C(x)||^2 / ||x||^2; also the share of the energy in the largest 1% of elements and the share
of exact zeros. This is the measurement behind docs/history/convergence-notebook.md ("Where the CNN's 1-bit error
comes from").

    python -m bench.onebit.error --task cnn_sgd_cosine --at 10,60,150
    python -m bench.onebit.error --task resmlp_sgd_warmup --smoke

Writes JSON (``--json``: records with task, step, layer, numel, dropped, top1_energy, zeros) and
prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.convergence import tasks
import ciuicflow.ops as ops

RANKS = 4  # the convergence suite's 2 nodes x 2 ranks


def dropped_share(x: torch.Tensor, chunk: int) -> float:
    """||x - C(x)||^2 / ||x||^2 for the native 1-bit codec C (no error memory)."""
    flat = x.detach().reshape(-1).float().contiguous()
    energy = float(flat.square().sum())
    if energy == 0.0:
        return 0.0
    error = torch.zeros_like(flat)
    packed, scales = ops.onebit_pack(flat, error, chunk)  # error becomes x - C(x)
    return float(error.square().sum()) / energy


def top_energy(x: torch.Tensor, share: float = 0.01) -> float:
    """The share of x's energy in its largest ``share`` of elements."""
    sq = x.detach().reshape(-1).float().square()
    total = float(sq.sum())
    if total == 0.0:
        return 0.0
    k = max(1, int(sq.numel() * share))
    return float(sq.topk(k).values.sum()) / total


def measure(task, at: list[int], chunk: int, min_numel: int = 1000) -> list[dict]:
    if task.optimizer != "sgd":
        raise SystemExit(f"{task.name} steps {task.optimizer}: this measures SGD tasks only")
    torch.manual_seed(task.seed)
    data = tasks.load_data(task)
    model = tasks.build_model(task)
    named = [(n, p) for n, p in model.named_parameters() if p.numel() >= min_numel]
    opt = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=task.momentum,
                          weight_decay=task.weight_decay)
    records = []
    for step in range(max(at) + 1):
        for group in opt.param_groups:
            group["lr"] = task.lr_at(step)
        model.train()
        rank_grads = []
        for rank in range(RANKS):
            model.zero_grad()
            x, y = tasks.batch(task, data, step, rank, RANKS)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=task.bf16):
                out = model(x)
            tasks.loss_fn(task, out, y).backward()
            if step in at:  # each layer's, and every parameter's end to end ("(all)")
                rank_grads.append({n: p.grad.clone() for n, p in named})
                rank_grads[-1]["(all)"] = [p.grad.clone() for p in model.parameters()]
            if rank == 0:
                total = [p.grad.clone() for p in model.parameters()]
            else:
                for t, p in zip(total, model.parameters()):
                    t.add_(p.grad)
        for t, p in zip(total, model.parameters()):
            p.grad = t.div_(RANKS)
        if step in at:
            whole = torch.cat([t.reshape(-1) for t in rank_grads[0]["(all)"]])
            records.append({"task": task.name, "step": step, "layer": "(all)",
                            "numel": whole.numel(), "dropped": dropped_share(whole, chunk),
                            "top1_energy": top_energy(whole),
                            "zeros": float((whole == 0).float().mean())})
            for name, _ in named:
                g = rank_grads[0][name]
                records.append({"task": task.name, "step": step, "layer": name,
                                "numel": g.numel(), "dropped": dropped_share(g, chunk),
                                "top1_energy": top_energy(g),
                                "zeros": float((g == 0).float().mean())})
        opt.step()
    return records


def table(records: list[dict]) -> str:
    lines = ["| task | step | layer | elements | dropped by 1-bit | energy in top 1% | zeros |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['task']} | {r['step']} | {r['layer']} | {r['numel']} | "
                     f"{r['dropped']:.2f} | {r['top1_energy']:.2f} | {r['zeros']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--task", default="cnn_sgd_cosine")
    p.add_argument("--at", default="10,60,150", help="comma-separated steps to measure at")
    p.add_argument("--chunk", type=int, default=ops.DEFAULT_CHUNK_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="steps 0 and 2 only (CI)")
    p.add_argument("--json", default="out/onebit_error.json")
    args = p.parse_args(argv)
    if args.task not in tasks.TASKS:
        raise SystemExit(f"unknown task {args.task!r}; choose from {sorted(tasks.TASKS)}")
    at = [0, 2] if args.smoke else sorted({int(s) for s in args.at.split(",")})
    task = tasks.TASKS[args.task]
    if task.seed != args.seed:
        from dataclasses import replace
        task = replace(task, seed=args.seed)
    if at[0] < 0 or at[-1] >= task.steps:
        raise SystemExit(f"--at steps must lie in [0, {task.steps - 1}] for {task.name}")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    records = measure(task, at, args.chunk)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": {"task": task.name, "at": at, "chunk": args.chunk,
                              "seed": task.seed, "ranks": RANKS}, "records": records}, f, indent=1)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
