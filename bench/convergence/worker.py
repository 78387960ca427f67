"""One rank of bench/convergence: trains one task once per method, from the same seed, on the
same batches, and rank 0 appends a JSON record per method to --out as soon as it is done.

Methods:
  exact            DDP with PyTorch's default all-reduce (its ``allreduce_hook``)
  <ciuicflow hook> every hook of ``ciuicflow.ddp.HOOKS``, registered with its default state
                   (``ciuicflow.register(ddp, name)``: nothing but the model's parameter names);
                   ``name@key=value;key=value`` sets options (comparisons only)
  torch_powerSGD   PyTorch's ``powerSGD_hook`` at the rank and warm-up of ciuicflow's
                   ``PowerSGDState`` defaults (``torch_powerSGD@rank=R``: at rank R); on gloo each
                   bucket's future is waited for inside the hook (as bench/comm does: its later
                   all-reduces interleave across buckets)
  onebit_adam, zero_one_adam   ciuicflow's 1-bit optimizers with their defaults, no DDP (Adam tasks)
  fsdp_hsdp        FSDP2's own HSDP (each child module with parameters, and the root,
                   fully_shard-ed over the 2-D mesh "replicate" x "shard")
  diloco, diloco_<codec>_h<H>[_f<F>][_d<D>]   DDP inside each node, ciuicflow.diloco across nodes
                   (bench/convergence/diloco_methods.py)
  fsdp:<method>    a hierarchical method of the registry: FSDP2 inside the node and
                   ``ciuicflow.fsdp.register(model, method)`` across nodes (HSDP's replicas, a
                   2-D mesh); a flat one ("onebit", "int8", "int4"): FSDP2 over every rank (a
                   1-D mesh) and ``register`` compresses its reduce-scatter; the method's defaults

inter_node_bytes_per_step: modelled bytes one rank sends to other nodes, per step, the model of
``ciuicflow.collectives`` (a ring all-reduce of B bytes over W ranks sends 2(W-1)/W B, of which the
share of peers on other nodes leaves the node). ciuicflow's states count their own; for exact and
PyTorch's PowerSGD every ``dist.all_reduce`` the hook issues is counted the same way.
"""
import argparse
import contextlib
import json
import os
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.convergence import diloco_methods as convergence_diloco
from bench.convergence import tasks
from bench.convergence.report import TORCH_POWERSGD
from bench.comm.worker import waiting  # noqa: E402  (PyTorch's PowerSGD hook made to work on gloo)

OPTIMIZER_METHODS = ("onebit_adam", "zero_one_adam")
FSDP_PREFIX = "fsdp:"


def is_fsdp(method: str) -> bool:
    return method == "fsdp_hsdp" or method.startswith(FSDP_PREFIX)


def fsdp_setup(model, method, options):
    """Shard ``model`` with FSDP2 as ``method`` says; (model, ciuicflow's state or None)."""
    import ciuicflow.fsdp
    from ciuicflow.fsdp.state import scatter_methods
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    name = method[len(FSDP_PREFIX):]
    if name in scatter_methods():  # FSDP over every rank: its reduce-scatter compressed
        mesh = on = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard"))
        on = mesh if method == "fsdp_hsdp" else mesh["shard"]
    for child in model.children():
        # a ModuleList has no forward of its own: FSDP2 shards its members instead
        for unit in (child if isinstance(child, torch.nn.ModuleList) else [child]):
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=on)
    fully_shard(model, mesh=on)
    if method == "fsdp_hsdp":
        return model, None
    return model, ciuicflow.fsdp.register(model, name, mesh=mesh, **options)


def flat_inter_share() -> float:
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return (world - local) / (world - 1) if world > 1 else 0.0


@contextlib.contextmanager
def counted_all_reduces(counter: list):
    """Count the modelled inter-node bytes of every dist.all_reduce issued inside."""
    original = dist.all_reduce
    world, share = dist.get_world_size(), flat_inter_share()

    def counting(tensor, *args, **kwargs):
        counter[0] += 2 * (world - 1) / world * tensor.numel() * tensor.element_size() * share
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield
    finally:
        dist.all_reduce = original


def parse_method(spec: str):
    """'onebit@phases=1;error_decay=0.8' -> ('onebit', {'phases': 1, 'error_decay': 0.8}): a hook
    with options other than its defaults (for comparisons; the suite's targets are for defaults).
    'a|b' is a tuple of values ('onebit@exclude=*.bias|0.weight')."""
    name, _, rest = spec.partition("@")
    options = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        if "|" in value:
            options[key] = tuple(value.split("|"))
            continue
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        options[key] = value
    return name, options


def make_optimizer(task, params):
    if task.optimizer == "sgd":
        return torch.optim.SGD(params, lr=task.lr, momentum=task.momentum,
                               weight_decay=task.weight_decay)
    if task.optimizer == "adam":
        return torch.optim.Adam(params, lr=task.lr, weight_decay=task.weight_decay)
    return torch.optim.AdamW(params, lr=task.lr, weight_decay=task.weight_decay)


def setup(task, method):
    """(model, the module to call, optimizer, hook state or None, byte counter)."""
    import ciuicflow
    from ciuicflow.compression.powersgd import PowerSGDCompressor
    from ciuicflow.ddp.hooks import DEFAULT_WARMUP_STEPS, HOOKS
    from ciuicflow.optim import OneBitAdam, ZeroOneAdam
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    model = tasks.build_model(task)
    name, options = parse_method(method)
    if name in OPTIMIZER_METHODS:
        cls = OneBitAdam if name == "onebit_adam" else ZeroOneAdam
        decay = task.weight_decay if task.optimizer == "adamw" else 0.0
        for p in model.parameters():  # every rank starts from the same weights
            dist.broadcast(p.data, 0)
        return model, model, cls(model.parameters(), lr=task.lr, weight_decay=decay,
                                 **options), None
    if is_fsdp(name):
        for p in model.parameters():  # every rank starts from the same weights
            dist.broadcast(p.data, 0)
        model, state = fsdp_setup(model, name, options)
        return model, model, make_optimizer(task, model.parameters()), state
    if convergence_diloco.is_diloco(name):  # DDP inside the node, ciuicflow.diloco across
        ddp, optimizer, state = convergence_diloco.setup(task, model, name, options,
                                                         make_optimizer)
        return model, ddp, optimizer, state
    ddp = DDP(model, bucket_cap_mb=task.bucket_cap_mb)
    state = None
    if method == "exact":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == TORCH_POWERSGD:
        # by default at the rank ciuicflow's PowerSGD sends this task's tensors with
        default = PowerSGDCompressor()
        rank = options.pop("rank", default.adaptive_rank if task.adam_family else default.rank)
        if options or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{method!r}: {TORCH_POWERSGD} takes one option, rank=<int >= 1>")
        state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                         start_powerSGD_iter=max(2, DEFAULT_WARMUP_STEPS))
        ddp.register_comm_hook(state, waiting(torch_psgd.powerSGD_hook))
        state = None
    elif name in HOOKS:
        state = ciuicflow.register(ddp, name, **options)
    else:
        raise ValueError(f"unknown method {method!r}")
    return model, ddp, make_optimizer(task, ddp.parameters()), state


def train(task, method, data, rank, world):
    model, module, optimizer, state = setup(task, method)
    counter = [0.0]
    eval_every = max(1, task.steps // task.evals)
    curve, losses = [], []
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if task.bf16 else \
        contextlib.nullcontext()
    optimizer_method = parse_method(method)[0] in OPTIMIZER_METHODS
    counting = counted_all_reduces(counter) if state is None and not optimizer_method \
        and not is_fsdp(method) else contextlib.nullcontext()
    start = time.perf_counter()
    with counting:
        for step in range(task.steps):
            for group in optimizer.param_groups:
                group["lr"] = task.lr_at(step)
            x, y = tasks.batch(task, data, step, rank, world)
            with autocast:
                loss = tasks.loss_fn(task, module(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if optimizer_method and step == task.steps // 2:
                second_half = replace(optimizer.traffic)
            optimizer.step()
            losses.append(float(loss))
            if (step + 1) % eval_every == 0 or step + 1 == task.steps:
                curve.append((step + 1, tasks.evaluate(task, model, data)))
    seconds = time.perf_counter() - start
    # whole parameters (FSDP's DTensors gathered inside the node): equal on every rank when the
    # nodes' replicas agree
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                        for p in model.parameters()])
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    record = {
        "task": task.name, "method": method, "metric": task.metric, "value": curve[-1][1],
        "curve": curve, "train_loss_last50": sum(losses[-50:]) / len(losses[-50:]),
        "replicas_equal": all(torch.equal(g, params) for g in gathered),
        "seconds": seconds, "params": params.numel(), "seed": task.seed,
    }
    if state is not None:
        stats = state.stats()
        record["inter_node_bytes_per_step"] = stats["inter_node_bytes_per_step"]
        record["compression_ratio"] = stats["compression_ratio"]
        record["stats"] = {k: v for k, v in stats.items() if k != "topology"}
    elif method == "fsdp_hsdp":  # each rank all-reduces its shard (1/L) with the other nodes
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        nodes = world // local
        record["inter_node_bytes_per_step"] = 2 * (nodes - 1) / nodes * params.numel() * 4 / local
        record["compression_ratio"] = None
    elif optimizer_method:
        record["inter_node_bytes_per_step"] = optimizer.traffic.inter_bytes / task.steps
        # past warm-up, as the hooks' stats() give it: over the run's second half (OneBitAdam's
        # freeze is long past; ZeroOneAdam's variance and local steps both counted)
        sent = optimizer.traffic.inter_bytes - second_half.inter_bytes
        exact = optimizer.traffic.exact_inter_bytes - second_half.exact_inter_bytes
        record["compression_ratio"] = exact / sent if sent else None
    else:
        record["inter_node_bytes_per_step"] = counter[0] / task.steps
        record["compression_ratio"] = None
    return record


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--task", required=True)
    p.add_argument("--methods", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=None, help="override the task's steps (smoke)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = replace(tasks.TASKS[args.task], seed=args.seed)
    if args.steps:
        # a short run (the smoke) evaluates twice, not at every step: evaluations cost more
        # than a dozen training steps
        task = replace(task, steps=args.steps, evals=min(task.evals, max(1, args.steps // 6)))
    data = tasks.load_data(task)
    for method in args.methods.split(","):
        try:
            record = train(task, method, data, rank, world)
        except Exception:
            if rank == 0:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"task": task.name, "method": method, "failed": True,
                                        "seed": task.seed,
                                        "error": traceback.format_exc()[-2000:]}) + "\n")
            raise
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[convergence] {task.name} {method}: {task.metric} {record['value']:.4f} "
                  f"({record['seconds']:.0f} s)", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
