"""What every rank of the cluster benches (bench/comm, bench/fsdp, bench/diloco) does alike: its
arguments, the loop over methods (a method that raises ends the launch, so that the launcher
starts the next launch after it), the progress lines and the record lines rank 0 appends."""

import argparse
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def say(line: str):
    """One write() per line: the ranks of a node share torchrun's output pipe, and print() may write in pieces."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


OPTIMIZERS = ("adam", "sgd")


def parser(description: str, steps: int, bucket_cap: bool = True, probe: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--methods", required=True, help="comma-separated method specs")
    p.add_argument("--params", type=float, required=True, help="model size in parameters")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4, help="the optimizer's learning rate")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="adam, or sgd (momentum 0.9): what DiLoCo's defaults follow")
    p.add_argument("--seed", type=int, default=0)
    if bucket_cap:
        p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (PyTorch's default: 25)")
    p.add_argument("--out", required=True, help="JSONL file rank 0 appends one record per method to")
    if probe:
        p.add_argument("--probe-numel", type=int, default=0,
                       help="after the methods, measure the machine for the planner with tensors of this size")
    return p


def make_optimizer(params, args):
    """The timed runs' optimizer: Adam, or SGD with momentum 0.9, at ``args.lr``."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.Adam(params, lr=args.lr)


def run_or_die(run, *args):
    """``run(*args)``; if it raises, the other ranks are probably stuck in a collective: this
    process dies at once and the launcher starts again after the method."""
    try:
        return run(*args)
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(3)


def report(record: dict, out: str):
    """Rank 0's line about a finished method, and its record appended to ``out``."""
    b = record["inter_node_bytes_per_step"]
    comm = f", comm {record['comm_seconds']:.3f} s" if record.get("comm_seconds") is not None else ""
    say(f"[bench] {record['method']}: {record['step_seconds']:.3f} s/step{comm}, inter-node "
        f"{'n/a' if b is None else f'{b / 1e6:.3f} MB'}/step, final loss {record['final_loss']:.5f}")
    append(out, record)


def append(out: str, obj: dict):
    with open(out, "a") as f:
        f.write(json.dumps(obj) + "\n")


def finish(args, **probe_options):
    """After the methods: the machine probe (``--probe-numel``) if asked, then leave together."""
    if getattr(args, "probe_numel", 0):
        from bench.comm.probe import probe_machine
        if dist.get_rank() == 0:
            say("[bench] measuring the machine for the planner ...")
        machine = probe_machine([args.probe_numel], **probe_options)
        if dist.get_rank() == 0:
            append(args.out, {"probe": machine})
    dist.barrier()
    dist.destroy_process_group()
