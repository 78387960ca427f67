"""The noise each codec adds to a node's gradient, with error feedback, on a task of the
convergence suite: offline (one process), towards a rule that decides by measured error
(docs/decisions.md, "Towards a measured rule").

The task trains on the exact mean of ``--nodes`` simulated nodes' gradients; past the warm-up, node
0's gradient is packed every step by each codec's native op with a memory of its own, and three
ratios are averaged over the run: ||e|| / ||g|| (the accuracy guard's measure), the same with each
coordinate divided by the optimizer's units (``optimizer_watch.units``: the running RMS,
sqrt(exp_avg_sq), floored; 1 under SGD), and the noise of the mean, ||e|| / sqrt(nodes), against
the mean gradient in those units. ``int4@units`` and ``int8@units`` quantise in those units (each
coordinate divided by its unit before packing, multiplied back after), as the hooks do for an
adaptive optimizer's tensors.

    python -m bench.convergence.codec_noise --tasks cnn_adam_step,regression_adam --json out/codec_noise.json
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bench.convergence import tasks as T

from ciuicflow import ops
from ciuicflow.compression import optimizer_watch

CODECS = {"onebit": ops.onebit_pack, "int4": ops.int4_pack, "int8": ops.int8_pack,
          "int4@units": ops.int4_pack, "int8@units": ops.int8_pack}
WARMUP = 10


def _optimizer(task, params):
    if task.optimizer == "sgd":
        return torch.optim.SGD(params, lr=task.lr, momentum=task.momentum)
    make = torch.optim.AdamW if task.optimizer == "adamw" else torch.optim.Adam
    return make(params, lr=task.lr, weight_decay=task.weight_decay)


def measure(task, nodes: int, steps: int | None = None) -> dict:
    data, model = T.load_data(task), T.build_model(task)
    params = list(model.parameters())
    optimizer_watch.watch()
    opt = _optimizer(task, params)
    n = sum(p.numel() for p in params)
    segments, offset = [], 0
    for p in params:
        segments.append((offset, p.shape))
        offset += p.numel()
    memory = {name: torch.zeros(n) for name in CODECS}
    sums = {name: [0.0, 0.0, 0.0] for name in CODECS}
    steps = steps or task.steps
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = task.lr_at(step)
        grads = []
        for node in range(nodes):
            x, y = T.batch(task, data, step, node, nodes)
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=task.bf16):
                out = model(x)
            T.loss_fn(task, out, y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        mean = torch.stack(grads).mean(0)
        if step >= WARMUP:
            units = optimizer_watch.units(params, segments, n, "cpu") if task.adam_family \
                else torch.ones(n)
            g = grads[0]
            for name, pack in CODECS.items():
                if name.endswith("@units"):  # packed in units, the memory kept in plain ones
                    scaled = memory[name] / units
                    pack((g / units).contiguous(), scaled, 256)
                    memory[name] = scaled * units
                else:
                    pack(g.contiguous(), memory[name], 256)  # the memory becomes what was not sent
                e = memory[name]
                s = sums[name]
                s[0] += float(e.norm() / g.norm())
                s[1] += float((e / units).norm() / (g / units).norm())
                s[2] += float((e / units).norm() / nodes ** 0.5 / (mean / units).norm())
        offset = 0
        for p in params:
            p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    counted = max(1, steps - WARMUP)
    return {"task": task.name, "nodes": nodes, "steps": steps, "optimizer": task.optimizer,
            "metric": T.evaluate(task, model, data),
            "codecs": {name: {"l2": s[0] / counted, "optimizer_units": s[1] / counted,
                              "vs_mean": s[2] / counted} for name, s in sums.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="cnn_adam_step,regression_adam,cnn_sgd_cosine")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--steps", type=int, help="override each task's steps")
    p.add_argument("--smoke", action="store_true", help="one task, 14 steps (CI)")
    p.add_argument("--json", default="codec_noise.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = ["regression_adam"] if args.smoke else [t for t in args.tasks.split(",") if t]
    unknown = [t for t in names if t not in T.TASKS]
    if unknown:
        p.error(f"unknown tasks {unknown}; choose from {sorted(T.TASKS)}")
    results = [measure(T.TASKS[t], args.nodes, 14 if args.smoke else args.steps) for t in names]
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print("| task | codec | L2 | optimizer's units | vs the mean |\n|---|---|---:|---:|---:|")
    for r in results:
        for name, c in r["codecs"].items():
            print(f"| {r['task']} | {name} | {c['l2']:.3f} | {c['optimizer_units']:.3f} | "
                  f"{c['vs_mean']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
