"""1-bit Adam against DeepSpeed's own Adam and torch Adam + DDP: step time and bytes, in one run.

The ranks run under torchrun on the simulated cluster of bench/comm (ciuicflow/testing/cluster.py: N network-namespace
nodes whose inter-node link is rate limited with tc); bytes on the wire are read from the links' counters. Same
model and data as bench/comm (an MLP fitting a fixed teacher, built by bench/comm/worker.py), same steps:

  ddp_adam               torch.optim.Adam, gradients all-reduced by DDP (exact)
  deepspeed_adam         DeepSpeed's engine with its own Adam (config {"type": "Adam", "torch_adam": true}), ZeRO 0
  onebit_adam            ciuicflow.optim.OneBitAdam, no DDP (hierarchical: 1-bit across nodes, exact inside a node)
  onebit_adam_flat       OneBitAdam(hierarchical=False): 1-bit on all traffic
  onebit_adam_deepspeed  OneBitAdam inside DeepSpeed's engine (deepspeed.initialize(optimizer=OneBitAdam(...)))
  zero_one_adam          ciuicflow.optim.ZeroOneAdam (0/1 Adam), variance frozen after the warm-up
  no_comm                local Adam, no communication: the compute floor

Each method runs --warmup unmeasured steps (the 1-bit optimizers' freeze_steps, frozen there as asked
(hold_until_stable=False), so every measured step is compressed; for 0/1 Adam, var_freeze_step), then
--steps measured ones. Measured per step: wall time (mean, slowest rank), bytes that left the
nodes on their inter-node links (veth counters, summed over nodes), and for the 1-bit optimizers the bytes their
collectives modelled. Without root/netns everything runs on loopback and every output says NOT SHAPED.

The full run also trains on sklearn's digits for --convergence-steps steps (longer than the tests): exact Adam
against OneBitAdam at several warm-up lengths, OneBitAdam compressing m instead of m / sqrt(v) (the paper),
OneBitAdam with exact momentum averaging (the frozen variance alone), and ZeroOneAdam with its variance frozen at
the same step (all frozen there as asked, hold_until_stable=False), for a softmax regression and an MLP. When the
optimizers freeze by themselves, and what early freezes cost, is bench/onebit/freeze.py's.

    python -m bench.onebit.adam                              # 25M-param MLP, 2 nodes x 2 ranks, 1 Gbit/s
    python -m bench.onebit.adam --smoke --json out/onebit_adam.json     # CI: tiny, well under a minute
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback

from bench.common.cluster_args import add_cluster_arguments

METHODS = ("ddp_adam", "deepspeed_adam", "onebit_adam", "onebit_adam_flat", "onebit_adam_deepspeed", "zero_one_adam",
           "no_comm")
DEEPSPEED_METHODS = ("deepspeed_adam", "onebit_adam_deepspeed")
SMOKE = dict(params=50_000, layers=2, batch=8, steps=3, warmup=2, nodes=2, ranks_per_node=2, convergence_steps=0,
             timeout=170)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_cluster_arguments(p, params_help="MLP size in parameters (default 25e6, as bench/comm)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first; the 1-bit optimizers' freeze_steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--convergence-steps", type=int, default=1000, help="digits training steps (0: skip)")
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps, no convergence runs: CI")
    p.add_argument("--json", metavar="PATH", default="out/onebit_adam/onebit_adam.json",
                   help="JSON output; the markdown table goes next to it (.md)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    p.add_argument("--require-netns", action="store_true", help="fail instead of falling back to loopback")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, started by torchrun
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.params = int(float(args.params))
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.method_list if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {','.join(METHODS)}")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    return args


# =========================================================================== one rank (under torchrun)

def _deepspeed_missing():
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # any import problem: skip the DeepSpeed methods and say why
        return f"deepspeed not importable ({type(exc).__name__}: {exc}); pip install 'ciuicflow[deepspeed]'"
    return None


def _stepper(name, model, args):
    """(step() -> loss, the optimizer whose traffic to report or None, what ran)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    loss_fn = torch.nn.MSELoss()
    if name in ("ddp_adam", "no_comm"):
        net = DDP(model) if name == "ddp_adam" else model
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        what = "torch.optim.Adam + DDP" if net is not model else "torch.optim.Adam, local only"
        return _plain_step(net, optimizer, loss_fn), None, what

    from ciuicflow.optim import OneBitAdam, ZeroOneAdam
    if name in DEEPSPEED_METHODS:
        import deepspeed
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 0.0,
                  "steps_per_print": 10 ** 9}
        if name == "deepspeed_adam":
            config["optimizer"] = {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}}
            optimizer, what = None, "DeepSpeed engine, ZeRO 0, its Adam (torch_adam)"
        else:
            optimizer = OneBitAdam(model.parameters(), lr=args.lr, freeze_steps=args.warmup,
                                   hold_until_stable=False)
            what = "DeepSpeed engine, ZeRO 0, ciuicflow OneBitAdam"
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def step(x, y):
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return step, optimizer, what

    if name == "zero_one_adam":
        optimizer = ZeroOneAdam(model.parameters(), lr=args.lr, var_freeze_step=args.warmup,
                                hold_until_stable=False)
        what = "ciuicflow ZeroOneAdam (hierarchical), no DDP"
    else:
        optimizer = OneBitAdam(model.parameters(), lr=args.lr, freeze_steps=args.warmup,
                               hold_until_stable=False, hierarchical=name == "onebit_adam")
        what = f"ciuicflow OneBitAdam(hierarchical={name == 'onebit_adam'}), no DDP"
    return _plain_step(model, optimizer, loss_fn), optimizer, what


def _plain_step(net, optimizer, loss_fn):
    """One training step without an engine: forward, backward, optimizer step; returns the loss."""
    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()
    return step


def run_method(name, args, width, data):
    import torch.distributed as dist
    from bench.comm.worker import build_model, node_link_delta, reduce_scalar
    from ciuicflow.testing.cluster import read_node_link_bytes

    setup_started = time.perf_counter()
    model = build_model(width, args.layers, 0)
    step, optimizer, what = _stepper(name, model, args)
    warmup_seconds, first_loss = [], None
    for _ in range(args.warmup):
        started = time.perf_counter()
        loss = step(*data)
        warmup_seconds.append(time.perf_counter() - started)
        first_loss = loss if first_loss is None else first_loss
    modelled_before = optimizer.traffic.inter_bytes if optimizer is not None else None
    dist.barrier()
    before = read_node_link_bytes() if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None
    dist.barrier()
    total = 0.0
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = step(*data)
        total += time.perf_counter() - started
    dist.barrier()
    wire = node_link_delta(before)
    measured = read_node_link_bytes() is not None
    world = dist.get_world_size()
    record = {
        "method": name, "what": what,
        "step_seconds": reduce_scalar(total / args.steps, dist.ReduceOp.MAX),
        "warmup_step_seconds": reduce_scalar(sum(warmup_seconds[1:] or warmup_seconds)
                                             / max(1, len(warmup_seconds[1:] or warmup_seconds)),
                                             dist.ReduceOp.MAX),
        "inter_node_bytes_per_step": wire / args.steps if measured else None,
        "first_loss": reduce_scalar(first_loss, dist.ReduceOp.SUM) / world,
        "final_loss": reduce_scalar(loss, dist.ReduceOp.SUM) / world,
        "method_seconds": reduce_scalar(time.perf_counter() - setup_started, dist.ReduceOp.MAX),
    }
    if optimizer is not None:  # what the optimizer's collectives modelled, this rank, all nodes' ranks summed
        modelled = (optimizer.traffic.inter_bytes - modelled_before) / args.steps
        record["modelled_inter_node_bytes_per_step"] = reduce_scalar(modelled, dist.ReduceOp.SUM)
        record["frozen"] = optimizer.frozen
    return record


# -- longer convergence runs on a real data set -------------------------------------------------------------

def _digits():
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = x[:, x.std(0) > 0]
    return (x - x.mean(0)) / x.std(0), torch.tensor(y)


def _train_digits(make_optimizer, exact, model_kind, steps, batch, lr, l2, seed):
    import torch
    import torch.distributed as dist
    from ciuicflow.collectives.hierarchical import hierarchical_all_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _digits()
    torch.manual_seed(seed)
    if model_kind == "softmax":
        model = torch.nn.Linear(x.shape[1], 10)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))

    def objective(xb, yb):
        return torch.nn.functional.cross_entropy(model(xb), yb) + l2 * sum((p ** 2).sum() for p in model.parameters())

    optimizer = make_optimizer(model.parameters(), lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / steps)
    shard = torch.arange(rank, x.shape[0], world)
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(steps):
        idx = shard[torch.randint(0, shard.numel(), (batch,), generator=generator)]
        optimizer.zero_grad()
        objective(x[idx], y[idx]).backward()
        if exact:
            grads = [p.grad for p in model.parameters()]
            flat = hierarchical_all_reduce(torch.cat([g.reshape(-1) for g in grads]))
            torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)])
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        return objective(x, y).item()


def run_convergence(steps):
    """Final full-data objective of exact Adam and OneBitAdam variants on digits (same steps, seeds, schedule)."""
    import torch
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam

    asked = dict(hold_until_stable=False)  # frozen where asked, the variance stable or not
    variants = {
        "onebit_adam": lambda freeze: lambda p, lr: OneBitAdam(p, lr=lr, freeze_steps=freeze, **asked),
        "onebit_adam_compress_m": lambda freeze: lambda p, lr: OneBitAdam(
            p, lr=lr, freeze_steps=freeze, scale_momentum_before_compress=False, **asked),
        "frozen_variance_exact_momentum": lambda freeze: lambda p, lr: OneBitAdam(
            [{"params": list(p), "compress": False}], lr=lr, freeze_steps=freeze, **asked),
        "zero_one_adam": lambda freeze: lambda p, lr: ZeroOneAdam(p, lr=lr, var_freeze_step=freeze,
                                                                  **asked),
    }
    rows = []
    for model_kind, lr, l2 in (("softmax", 3e-2, 1e-3), ("mlp", 3e-3, 0.0)):
        for seed in (0,):
            started = time.perf_counter()
            adam = _train_digits(lambda p, lr: torch.optim.Adam(p, lr=lr), True, model_kind, steps, 32, lr, l2, seed)
            row = {"model": model_kind, "seed": seed, "steps": steps, "batch": 32, "lr": lr, "l2": l2, "adam": adam,
                   "variants": {}}
            for fraction in (0.2, 0.4):
                freeze = max(1, int(steps * fraction))
                for name, make in variants.items():
                    loss = _train_digits(make(freeze), False, model_kind, steps, 32, lr, l2, seed)
                    row["variants"][f"{name}@{fraction:.0%}"] = loss
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
    return rows


def worker_main(args):
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from bench.comm.worker import make_batch, mlp_width
    from ciuicflow.testing.cluster import ENV_SHAPED

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))

    rank = dist.get_rank()
    width = mlp_width(args.params, args.layers)
    data = make_batch(width, args.batch, 0, rank)

    def emit(record):
        if rank == 0:
            record.update(width=width, layers=args.layers, params=args.layers * (width * width + width),
                          batch=args.batch, steps=args.steps, warmup=args.warmup, world_size=dist.get_world_size(),
                          shaped=os.environ.get(ENV_SHAPED) == "1")
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    ds_missing = _deepspeed_missing() if any(m in DEEPSPEED_METHODS for m in args.method_list) else None
    for name in args.method_list:
        if name in DEEPSPEED_METHODS and ds_missing:
            emit({"method": name, "skipped": ds_missing})
            continue
        try:
            emit(run_method(name, args, width, data))
        except Exception as exc:  # a method that fails on every rank alike is recorded; the rest still run
            emit({"method": name, "failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    if args.convergence_steps:
        rows = run_convergence(args.convergence_steps)
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({"convergence": rows}) + "\n")
    dist.destroy_process_group()


# =========================================================================== the launcher

def _fmt_bytes(n):
    if n is None:
        return "not measured"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def markdown(records, convergence, header):
    base = next((r for r in records if r["method"] == "ddp_adam" and "step_seconds" in r), None)
    lines = [header, "", "| method | step time | vs ddp_adam | inter-node bytes / step (wire) | "
             "modelled by the optimizer | final loss | what |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in records:
        if "step_seconds" not in r:
            lines.append(f"| {r['method']} | - | - | - | - | - | {r.get('skipped') or 'FAILED: ' + r['failed']} |")
            continue
        speed = f"{base['step_seconds'] / r['step_seconds']:.2f}x" if base else "n/a"
        modelled = r.get("modelled_inter_node_bytes_per_step")
        lines.append(f"| {r['method']} | {r['step_seconds'] * 1e3:.1f} ms | {speed} | "
                     f"{_fmt_bytes(r['inter_node_bytes_per_step'])} | "
                     f"{_fmt_bytes(modelled) if modelled is not None else '-'} | {r['final_loss']:.4g} | {r['what']} |")
    if convergence:
        names = list(convergence[0]["variants"])
        lines += ["", f"Digits, {convergence[0]['steps']} steps of {convergence[0]['batch']} samples per rank, lr "
                  "decaying linearly to 0: final full-data objective, and its gap to exact Adam.", "",
                  "| model | seed | exact Adam | " + " | ".join(names) + " |",
                  "|---|---:|---:|" + "---:|" * len(names)]
        for row in convergence:
            cells = [f"{row['variants'][n]:.4f} ({row['variants'][n] / row['adam'] - 1:+.1%})" for n in names]
            lines.append(f"| {row['model']} | {row['seed']} | {row['adam']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _finished(lines_path):
    """What the workers have written so far: the methods with a record (measured, skipped or failed),
    and "convergence" once its rows are in."""
    with open(lines_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r.get("method") or ("convergence" if "convergence" in r else None) for r in records} - {None}


def _killed_by_signal(error):
    """Whether the rank torchrun names as the root cause died by a signal (a Python exception exits 1;
    the ranks torchrun stops afterwards die by SIGTERM, and are not the root cause)."""
    root = re.search(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", error, re.S)
    return root is not None and int(root.group(1)) < 0


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    from ciuicflow.testing.cluster import SimCluster

    out_path = os.path.abspath(args.json)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        lines_path = f.name
    os.chmod(lines_path, 0o666)
    rate = None if str(args.rate).lower() == "none" else args.rate
    started = time.monotonic()
    with SimCluster(args.nodes, args.ranks_per_node, rate, require_netns=args.require_netns, log=log) as cluster:
        worker_args = ["-m", "bench.onebit.adam", "--worker", "--out", lines_path, "--methods",
                       ",".join(args.method_list), "--params", args.params, "--layers", args.layers,
                       "--batch", args.batch, "--steps", args.steps, "--warmup", args.warmup, "--lr", args.lr,
                       "--convergence-steps", args.convergence_steps]
        error, crashes = None, []
        for attempt in range(2):
            error = None
            done = _finished(lines_path)
            remaining = [m for m in args.method_list if m not in done]
            if not remaining and (not args.convergence_steps or "convergence" in done):
                break
            methods_at = worker_args.index("--methods") + 1
            worker_args[methods_at] = ",".join(remaining)
            try:
                run = cluster.torchrun(worker_args, timeout=max(1.0, args.timeout - (time.monotonic() - started)))
                if not run.ok:
                    error = f"exit codes {run.returncodes}:\n" + "\n".join(
                        f"--- node {k} (exit {code})\n{o[-3000:]}" for k, (code, o)
                        in enumerate(zip(run.returncodes, run.outputs)))
            except TimeoutError as exc:
                error = str(exc)[-6000:]
            if error is None or attempt == 1 or not _killed_by_signal(error):
                break
            # a rank died by a signal inside a native library (seen once in CI: SIGABRT, "terminate called
            # without an active exception", right after DeepSpeed's engine set up); run the methods that did
            # not finish once more, and say so in the JSON and the table
            crashed = [m for m in remaining if m not in _finished(lines_path)]
            crashes.append({"methods_not_finished": crashed, "output": error[-6000:]})
            log(f"a worker was killed by a signal while running {crashed}; running those once more:\n{error}")
        describe = cluster.describe()
        shaped = cluster.shaped
    with open(lines_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    os.unlink(lines_path)
    records = [r for r in lines if "method" in r]
    convergence = next((r["convergence"] for r in lines if "convergence" in r), [])
    done = {r["method"] for r in records}
    for name in args.method_list:
        if name not in done:
            records.append({"method": name, "failed": "did not finish" + (f" ({error.splitlines()[0]})" if error else "")})
    header = (f"1-bit Adam benchmark: {describe}; {records[0].get('params', '?')} parameters, "
              f"{args.warmup} warm-up + {args.steps} measured steps, batch {args.batch} per rank, "
              f"{time.monotonic() - started:.0f} s")
    if not shaped:
        header = "**NOT SHAPED: inter-node links not simulated, inter-node bytes not measured.** " + header
    table = markdown(records, convergence, header)
    if crashes:
        table += "".join(f"\nA worker was killed by a signal; {', '.join(c['methods_not_finished'])} ran again "
                         "(the output is in the JSON's `crashes`).\n" for c in crashes)
    with open(out_path, "w") as f:
        json.dump({"cluster": describe, "shaped": shaped, "args": {k: v for k, v in vars(args).items()
                                                                  if k not in ("worker", "out")},
                   "records": records, "convergence": convergence, "error": error, "crashes": crashes},
                  f, indent=1)
    with open(os.path.splitext(out_path)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    if error:
        log(f"worker error: {error}")
    failed = [r["method"] for r in records if "failed" in r]
    if failed:
        log(f"FAILED: {failed}")
    return 1 if failed or error else 0


if __name__ == "__main__":
    sys.exit(main())
