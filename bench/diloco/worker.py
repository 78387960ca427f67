"""One rank of bench/diloco, started by torchrun on each simulated node (ciuicflow/testing/cluster.py).

The synchronous methods (``allreduce``, a ciuicflow hook, ``no_comm``) run exactly as bench/comm's
worker runs them (``comm_worker.run_method``: same model, data, optimizer (``--optimizer``), timing
and link counters). A DiLoCo method (``diloco``: its defaults, which follow the optimizer; or
``diloco_<codec>_h<H>[_f<F>][_d<D>[_k]]``, bench/convergence/diloco_methods.py's names, with
``@outer_lr=..;outer_momentum=..`` options) runs the same model with DDP over the node's ranks and
``ciuicflow.DiLoCo`` across nodes, timed the same way:

  step_seconds   wall time of forward + backward (DDP inside the node) + optimizer step + DiLoCo's step
                 (a sync's exchange when one is due, or waiting for one in flight), mean over the
                 measured steps, slowest rank; the measured steps are a whole number of periods H
                 (warm-up steps first), so every fragment's sync is in them the same number of times
  comm_seconds   DiLoCo's network wait (stats()["network_wait_seconds"]) per measured step, slowest
                 rank: the training thread blocked on the outer exchange
  inter_node_bytes_per_step  the node links' tx counters between barriers, summed over nodes, per
                 measured step (syncs still in flight at the end are waited for first)
"""
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.comm import worker as comm_worker
from bench.convergence import diloco_methods as convergence_diloco
from bench.common import worker as common_worker
from ciuicflow.testing.cluster import ENV_SHAPED, read_node_link_bytes
from bench.comm.worker import build_model, make_batch, mlp_width, node_link_delta, reduce_scalar
from bench.common.worker import say


def split_options(spec: str):
    name, _, rest = spec.partition("@")
    options = {}
    for item in filter(None, rest.split(";")):
        key, _, value = item.partition("=")
        options[key] = value
    return name, options


def check_method(spec: str) -> None:
    """Raise ValueError for a spec neither comm_worker nor DiLoCo knows (before anything starts)."""
    name, options = split_options(spec)
    if convergence_diloco.is_diloco(name):
        convergence_diloco.parse(name, options)
    else:
        if options:
            raise ValueError(f"{spec!r}: only DiLoCo methods take @options here")
        comm_worker.parse_method(name)


def run_diloco(spec, args, width, data, node_group):
    import ciuicflow.diloco as diloco

    name, options = split_options(spec)
    kwargs = convergence_diloco.parse(name, options)
    model = build_model(width, args.layers, args.seed)
    ddp = DDP(model, process_group=node_group, bucket_cap_mb=args.bucket_cap_mb)
    opt = common_worker.make_optimizer(ddp.parameters(), args)
    outer = diloco.DiLoCo(ddp, opt, **kwargs)
    period = outer.sync_every  # "auto" resolved by the optimizer
    warmup = args.warmup
    steps = max(period, -(-args.steps // period) * period)  # whole periods
    loss_fn = torch.nn.MSELoss()
    x, y = data

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()  # DiLoCo's step() runs in its post-hook
        return time.perf_counter() - t0, loss.item()

    first_loss = None
    for _ in range(warmup):
        _, loss = step()
        first_loss = loss if first_loss is None else first_loss
    outer.reset_stats()
    dist.barrier()
    leader = int(os.environ.get("LOCAL_RANK", 0)) == 0
    before = read_node_link_bytes() if leader else None
    dist.barrier()
    total, loss = 0.0, float("nan")
    cpu_start = time.process_time()
    for _ in range(steps):
        seconds, loss = step()
        total += seconds
    cpu = time.process_time() - cpu_start
    stats = outer.stats()
    outer.close()  # syncs still in flight land before the link is read
    dist.barrier()
    inter = node_link_delta(before)
    measured = read_node_link_bytes() is not None
    world = dist.get_world_size()
    record = {
        "method": spec, "hook": "diloco", "rank": None,
        "step_seconds": reduce_scalar(total / steps, dist.ReduceOp.MAX),
        "comm_seconds": reduce_scalar(stats["network_wait_seconds"] / steps, dist.ReduceOp.MAX),
        "cpu_seconds": reduce_scalar(cpu / steps, dist.ReduceOp.SUM) / world,
        "inter_node_bytes_per_step": inter / steps if measured else None,
        "first_loss": reduce_scalar(first_loss, dist.ReduceOp.SUM) / world,
        "final_loss": reduce_scalar(loss, dist.ReduceOp.SUM) / world,
        "measured_steps": steps,
        "note": f"ciuicflow.DiLoCo(sync_every={period}, fragments={stats['fragments']}, "
                f"fragment_sync_delay={stats['fragment_sync_delay']}, codec={outer.codec!r}); "
                f"DDP inside the node, {type(opt).__name__}",
        "hook_stats": json.loads(json.dumps(stats, default=str)),
    }
    return record


def main(argv=None):
    args = common_worker.parser(__doc__.split("\n")[0], steps=16, probe=False).parse_args(argv)
    specs = [s for s in args.methods.split(",") if s]
    for spec in specs:
        check_method(spec)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    width = mlp_width(int(args.params), args.layers)
    data = make_batch(width, args.batch, args.seed, rank)
    node_group = None
    if any(convergence_diloco.is_diloco(split_options(s)[0]) for s in specs):
        import ciuicflow.diloco as diloco
        node_group = diloco.node_group()  # once: every rank builds every node's group

    for spec in specs:
        name, _ = split_options(spec)
        if rank == 0:
            say(f"[bench] {spec} ...")
        if convergence_diloco.is_diloco(name):
            record = common_worker.run_or_die(run_diloco, spec, args, width, data, node_group)
        else:
            record = common_worker.run_or_die(comm_worker.run_method, name, args, width, data)
        if rank == 0:
            record.update(width=width, layers=args.layers, params=args.layers * (width * width + width),
                          batch=args.batch, steps=record.get("measured_steps", args.steps),
                          warmup=args.warmup, world_size=dist.get_world_size(), optimizer=args.optimizer,
                          bucket_cap_mb=args.bucket_cap_mb, shaped=os.environ.get(ENV_SHAPED) == "1")
            common_worker.report(record, args.out)
    common_worker.finish(args)


if __name__ == "__main__":
    main()
