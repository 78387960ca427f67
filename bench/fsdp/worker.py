"""One rank of bench/fsdp, started by torchrun on each simulated node (ciuicflow/testing/cluster.py).

Per method, the same MLP (bench/comm/worker.py's model and data) is sharded by FSDP2 and trained with
Adam for --warmup unmeasured and --steps measured steps; rank 0 appends one JSON record per method to
--out. Methods:
  hsdp      FSDP2's own HSDP: every layer fully_shard-ed over the 2-D mesh (replicate x shard)
  <method>  a hierarchical method of ciuicflow's registry: sharded over mesh["shard"] (inside the node),
            the shards reduced across nodes by ciuicflow.fsdp.register(model, method, mesh=mesh)
  fsdp      FSDP2 over every rank (a 1-D mesh), its own reduce-scatter (crossing nodes)
  fsdp:<m>  the same with ciuicflow's compressed reduce-scatter, m a quantising flat method of the
            registry (onebit, int8): ciuicflow.fsdp.register(model, m, mesh=mesh_1d)
  no_comm   the model alone, no FSDP and no communication: the compute floor
Measured: step_seconds (forward + backward + Adam, mean over measured steps, slowest rank),
ciuicflow_seconds (time in ciuicflow's reduction per step, from state.stats()), inter_node_bytes_per_step
(the node links' tx counters, summed over nodes), final_loss.
"""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.comm.worker import as_named, build_model, make_batch, mlp_width, node_link_delta, reduce_scalar

from bench.common import worker as common_worker
from bench.common.worker import say
from ciuicflow.testing.cluster import ENV_SHAPED, read_node_link_bytes
from ciuicflow.compression import registry
from ciuicflow.fsdp.state import scatter_methods

OURS = tuple(name for name, m in registry.METHODS.items() if m.hierarchical)
SCATTER = tuple(f"fsdp:{name}" for name in scatter_methods())
METHODS = ("hsdp",) + OURS + ("fsdp",) + SCATTER + ("no_comm",)


def shard(model, method, mesh, warmup_steps):
    """FSDP2 over the layers and the root; ciuicflow's state (or None). ``mesh``: (2-D, 1-D)."""
    import ciuicflow.fsdp
    from torch.distributed.fsdp import fully_shard

    mesh, mesh_1d = mesh
    if method == "no_comm":
        return None
    every_rank = method == "fsdp" or method.startswith("fsdp:")
    on = mesh_1d if every_rank else mesh if method == "hsdp" else mesh["shard"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    if method in ("hsdp", "fsdp"):
        return None
    if every_rank:  # the compressed reduce-scatter
        name = method.split(":", 1)[1]
        return ciuicflow.fsdp.register(model, name, mesh=mesh_1d, warmup_steps=warmup_steps,
                                       **as_named(name))
    return ciuicflow.fsdp.register(model, method, mesh=mesh, warmup_steps=warmup_steps,
                                   **as_named(method))


def run_method(method, args, width, data, mesh):
    model = build_model(width, args.layers, args.seed)
    state = shard(model, method, mesh, warmup_steps=min(1, args.warmup))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    x, y = data

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, loss.item()

    for _ in range(args.warmup):
        step()
    if state is not None:
        state.reset_stats()
    dist.barrier()
    before = read_node_link_bytes() if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None
    dist.barrier()
    total, loss = 0.0, float("nan")
    for _ in range(args.steps):
        seconds, loss = step()
        total += seconds
    dist.barrier()
    inter = node_link_delta(before)
    measured = read_node_link_bytes() is not None
    stats = state.stats() if state is not None else {}
    world = dist.get_world_size()
    return {
        "method": method,
        "step_seconds": reduce_scalar(total / args.steps, dist.ReduceOp.MAX),
        "ciuicflow_seconds": reduce_scalar(stats.get("time_s", 0.0) / args.steps, dist.ReduceOp.MAX),
        "inter_node_bytes_per_step": inter / args.steps if measured else None,
        "modelled_inter_node_bytes_per_step": reduce_scalar(
            stats.get("inter_node_bytes", 0) / args.steps, dist.ReduceOp.SUM) if stats else None,
        "compression_ratio": stats.get("compression_ratio"),
        "final_loss": reduce_scalar(loss, dist.ReduceOp.SUM) / world,
        # for the planner's rows (bench/comm/plan_calibration.py: calibrate_fsdp): Adam steps, the 1-bit states send their own codec
        "optimizer": "adam",
        "adaptive_optimizer": as_named(method.split(":", 1)[-1]).get("adaptive_optimizer", "")
        if state is not None else "",
    }


def main(argv=None):
    p = common_worker.parser(__doc__.split("\n")[0], steps=5, bucket_cap=False)
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {METHODS}")

    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    mesh = (init_device_mesh("cpu", (world // local, local), mesh_dim_names=("replicate", "shard")),
            init_device_mesh("cpu", (world,)))
    width = mlp_width(int(args.params), args.layers)
    data = make_batch(width, args.batch, args.seed, rank)
    for method in methods:
        if rank == 0:
            say(f"[bench] {method} ...")
        record = common_worker.run_or_die(run_method, method, args, width, data, mesh)
        if rank == 0:
            record.update(width=width, layers=args.layers, params=args.layers * (width * width + width),
                          batch=args.batch, steps=args.steps, warmup=args.warmup, world_size=world,
                          shaped=os.environ.get(ENV_SHAPED) == "1")
            common_worker.report(record, args.out)
    common_worker.finish(args, intra_path="gloo", shard_cols=width)


if __name__ == "__main__":
    main()
