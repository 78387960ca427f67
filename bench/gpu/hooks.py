"""Every DDP hook on one GPU: 4 processes share the device (2 simulated nodes x 2), gloo carries
CUDA tensors, against DDP's own all-reduce in the same run.

Per method: the median step time, the hook's own time per step (``stats()["time_s"]``, timed with
CUDA events on the stream the hooks run on) and the modelled inter-node bytes per step. On one GPU
gloo stages every collective through host memory, so the step times say what the compression
costs on the device and that the CUDA path works end to end, not what NCCL across nodes would do.

    python -m bench.gpu.hooks --json out/gpu_hooks.json          # on a GPU machine
    python -m bench.gpu.hooks --device cpu --smoke --json out/gpu_hooks.json   # CI: the same code
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from ciuicflow.compression.registry import METHODS
from ciuicflow.testing.processes import run_distributed


def _model(width: int, layers: int, device) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10)).to(device)


def _time_method(method, args, device):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow

    model = _model(args.width, args.layers, device)
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=25)
    state = None
    if method != "ddp_allreduce":
        options = {"warmup_steps": 0} if METHODS[method].compresses else {}
        state = ciuicflow.register(ddp, method, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, before = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup and state is not None:
            before = state.stats()  # the timed steps only: set-up and warm-up left out
        sync()
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    record = {"method": method, "step_s": statistics.median(times),
              "params": sum(p.numel() for p in model.parameters())}
    if state is not None:
        after = state.stats()
        per_step = {key: (after[key] - before[key]) / args.steps
                    for key in ("time_s", "inter_node_bytes", "exact_inter_node_bytes")}
        record.update(hook_s_per_step=per_step["time_s"],
                      inter_node_bytes_per_step=per_step["inter_node_bytes"],
                      exact_inter_node_bytes_per_step=per_step["exact_inter_node_bytes"])
    return record


def _rank(rank, world, args):
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return [_time_method(method, args, device) for method in ["ddp_allreduce", *sorted(METHODS)]]


def markdown(records, args) -> str:
    base = records[0]["step_s"]
    lines = [f"4 ranks on one {args.device} device (2 simulated nodes x 2, gloo), "
             f"{records[0]['params'] / 1e6:.1f}M parameters, batch {args.batch}",
             "", "| method | step ms | vs DDP all-reduce | hook ms/step | inter-node KB/step | "
             "vs exact bytes |", "|---|---:|---:|---:|---:|---:|"]
    for r in records:
        hook = f"{1e3 * r['hook_s_per_step']:.2f}" if "hook_s_per_step" in r else "-"
        kb = f"{r['inter_node_bytes_per_step'] / 1e3:.1f}" if "hook_s_per_step" in r else "-"
        ratio = (f"1/{r['exact_inter_node_bytes_per_step'] / r['inter_node_bytes_per_step']:.1f}"
                 if r.get("inter_node_bytes_per_step") else "-")
        lines.append(f"| {r['method']} | {1e3 * r['step_s']:.2f} | {r['step_s'] / base:.2f}x | "
                     f"{hook} | {kb} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a small model, 2 steps (CI)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.layers, args.batch, args.steps, args.warmup = 64, 2, 8, 2, 1
    if args.device == "cuda":
        from ciuicflow import ops

        if not torch.cuda.is_available() or not ops.has_cuda_kernels():
            parser.error("needs a CUDA device and a build with CUDA kernels")
    records = run_distributed(_rank, 4, nodes=2, args=(args,), timeout=600)[0]
    table = markdown(records, args)
    print(table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "records": records}, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
