"""``ciuicflow demo``: 2 simulated nodes x 2 ranks on loopback (gloo), one small model trained on
scikit-learn's bundled 8x8 digits (no download) with exact all-reduce and with each hook.

Every rank runs in its own process with torchrun's node variables set (``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``LOCAL_RANK``), so ``Topology.detect`` sees two nodes. Every method starts from
the same weights and sees the same batches; the table gives the test accuracy at the end, the
inter-node bytes per step and the compression ratio after warm-up (modelled bytes, see
``ciuicflow.collectives``), and the step time. Loopback has no slow link: step times here show the
cost of compression on the CPU, not the savings on a network.
"""
import argparse
import sys

from ciuicflow.compression import registry

METHODS = ("exact", *registry.METHODS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per method")
    parser.add_argument("--warmup-steps", type=int, default=10,
                        help="exact steps before compression starts")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="momentum-SGD learning rate")
    parser.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1,
                        help="DDP bucket size; small, so several buckets are in flight")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole demo")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    import json
    import sys

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        print(f"ciuicflow demo: unknown methods {unknown}; choose from {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    if args.nodes < 1 or args.ranks_per_node < 1 or args.steps <= args.warmup_steps:
        print("ciuicflow demo: need nodes >= 1, ranks-per-node >= 1 and steps > warmup-steps",
              file=sys.stderr)
        return 2
    try:
        results = _launch(args, methods)
    except RuntimeError as exc:
        print(f"ciuicflow demo failed: {exc}", file=sys.stderr)
        return 1
    print(_table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2, default=str)
        print(f"results written to {args.json}")
    return 0


# -- the launcher (parent process) --------------------------------------------------------------


def _launch(args, methods):
    import datetime
    import multiprocessing
    import queue
    import time

    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from tqdm import tqdm

    world = args.nodes * args.ranks_per_node
    digits = load_digits()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                                "ciuicflow.ddp"])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=args.timeout))
    messages = ctx.Queue()
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    processes = []
    for rank in range(world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "LOCAL_WORLD_SIZE": str(args.ranks_per_node),
               "GROUP_RANK": str(rank // args.ranks_per_node),
               "LOCAL_RANK": str(rank % args.ranks_per_node),
               "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        p = ctx.Process(target=_worker, daemon=True,
                        args=(rank, world, store.port, env, config, methods,
                              (digits.data, digits.target), messages))
        p.start()
        processes.append(p)

    results, done, deadline = None, set(), time.monotonic() + args.timeout
    # a bar on a terminal; in a log, one line per method when it finishes (a bar's redraws would
    # fill it with hundreds of lines)
    on_terminal = sys.stderr.isatty()
    bar = tqdm(total=len(methods) * args.steps, unit="step",
               disable=args.no_progress or not on_terminal,
               desc=f"{args.nodes} nodes x {args.ranks_per_node} ranks")
    steps_done: dict[str, int] = {}
    started = time.monotonic()
    try:
        while len(done) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {args.timeout:.0f} s")
            try:
                kind, rank, payload = messages.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if not p.is_alive() and r not in done]
                if dead and messages.empty():
                    raise RuntimeError(f"rank {dead[0]} exited with code "
                                       f"{processes[dead[0]].exitcode}")
                continue
            if kind == "progress":
                bar.set_postfix_str(payload[0])
                bar.update(payload[1])
                steps_done[payload[0]] = steps_done.get(payload[0], 0) + payload[1]
                if not on_terminal and not args.no_progress and payload[1] \
                        and steps_done[payload[0]] == args.steps:
                    print(f"[demo] {payload[0]}: {args.steps} steps "
                          f"({time.monotonic() - started:.1f} s since start)", file=sys.stderr,
                          flush=True)
            elif kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            elif kind == "done":
                done.add(rank)
                if rank == 0:
                    results = payload
    finally:
        bar.close()
        for p in processes:
            if p.is_alive() and len(done) < world:
                p.kill()
        for p in processes:
            p.join(timeout=10)
    return results


def _table(results, args) -> str:
    from ciuicflow.compression.policy import explain
    from ciuicflow.compression.registry import METHODS as REGISTERED

    rows = [("method", "what crosses nodes (ciuicflow.explain)", "test acc %", "inter-node B/step",
             "compression", "step ms")]
    for r in results:
        ratio = "-" if r["compression_ratio"] is None else f"{r['compression_ratio']:.1f}x"
        sends = explain(r["method"], nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                        device="cpu").summary() if r["method"] in REGISTERED \
            else "exact, DDP's all-reduce"
        rows.append((r["method"], sends, f"{r['accuracy']:.1f}",
                     f"{r['inter_node_bytes_per_step']:,.0f}", ratio,
                     f"{1000 * r['step_time_s']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w)
                       in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    params = results[0]["parameters"] if results else 0
    notes = [
        "",
        f"{args.nodes} simulated nodes x {args.ranks_per_node} ranks, gloo on loopback; MLP "
        f"64-{args.hidden}-{args.hidden}-10 ({params:,} parameters), {args.steps} steps of "
        f"momentum SGD, global batch {args.batch}; compressed after {args.warmup_steps} exact "
        "steps.",
        "Bytes: modelled bytes one rank sends to other nodes per step after warm-up "
        "(bandwidth-optimal collectives); 'exact' is DDP's flat all-reduce without a hook.",
        "Step time: on loopback and shared CPU cores it shows compression cost, not network "
        "savings.",
    ]
    return "\n".join(lines + notes)


# -- one rank (child process) -------------------------------------------------------------------


def _worker(rank, world, port, env, config, methods, digits, messages):
    import datetime
    import os
    import traceback

    try:
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=config["timeout"]))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=config["timeout"]))
        dist.barrier()
        results = [_train_one(method, rank, world, config, digits, messages) for method in methods]
        dist.barrier()
        dist.destroy_process_group()
        messages.put(("done", rank, results))
    except BaseException:
        messages.put(("error", rank, traceback.format_exc()))


def _train_one(method, rank, world, config, digits, messages):
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ciuicflow
    from ciuicflow.collectives.primitives import Hop, ring_all_reduce_bytes

    x_train, y_train, x_test, y_test = _split(digits, config["seed"])
    torch.manual_seed(config["seed"])
    hidden = config["hidden"]
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 10))
    ddp = DDP(model, bucket_cap_mb=config["bucket_cap_mb"])
    state = None
    if method != "exact":
        options = {}
        if method != "hierarchical_allreduce":
            options["warmup_steps"] = config["warmup_steps"]
        if registry.method(method).entry.cost.kind == "lowrank":
            options["rank"] = config["rank"]
        state = ciuicflow.register(ddp, method, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config["lr"], momentum=0.9)
    steps, warmup, batch = config["steps"], config["warmup_steps"], config["batch"]
    step_times, report_every = [], max(1, steps // 50)
    for step in range(steps):
        if step == warmup and state is not None:
            state.reset_stats()  # bytes and ratio after warm-up
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = config["lr"] * (1 - step / steps)
        index = torch.randint(0, len(y_train), (batch,),
                              generator=torch.Generator().manual_seed(config["seed"] + step))
        mine = index[rank::world]
        loss = torch.nn.functional.cross_entropy(ddp(x_train[mine]), y_train[mine])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step >= warmup:
            step_times.append(time.perf_counter() - start)
        if rank == 0 and (step + 1) % report_every == 0:
            messages.put(("progress", 0, (method, report_every)))
    if rank == 0 and steps % report_every:
        messages.put(("progress", 0, (method, steps % report_every)))

    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    parameters = sum(p.numel() for p in model.parameters())
    if state is None:  # DDP's own flat all-reduce: the same byte model, computed
        hop = Hop.flat(ciuicflow.Topology.detect())
        inter_per_step = ring_all_reduce_bytes(parameters * 4, world) * hop.inter_share
        ratio = None
    else:
        stats = state.stats()
        inter_per_step = stats["inter_node_bytes_per_step"]
        ratio = stats["compression_ratio"] or stats["overall_compression_ratio"]
    times = torch.tensor(step_times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    return {"method": method, "accuracy": accuracy, "inter_node_bytes_per_step": inter_per_step,
            "compression_ratio": ratio, "step_time_s": times.median().item(),
            "parameters": parameters}


def _split(digits, seed):
    import torch

    x = torch.tensor(digits[0], dtype=torch.float32)
    y = torch.tensor(digits[1], dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    train, test = slice(0, 1297), slice(1297, None)
    mean, std = x[train].mean(0), x[train].std(0) + 1e-3
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]
