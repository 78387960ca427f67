"""One rank of bench/comm, started by torchrun on each simulated node (see ciuicflow/testing/cluster.py).

Trains the same MLP on the same data for the same number of steps once per method (a DDP communication hook),
and rank 0 appends one JSON record per method to --out as soon as the method is done, so a method that kills the
job loses only itself (bench/comm relaunches with the rest).

Per method: build the model from the same seed, wrap it in DDP, register the hook, run --warmup steps
(not measured: DDP rebuilds its buckets after step 1 and PowerSGD starts compressing at step 2), then --steps
measured steps. Measured:
  step_seconds   wall time of forward + backward (incl. waiting for the hook) + optimizer step (Adam; SGD with --optimizer sgd), mean over the
                 measured steps, slowest rank
  comm_seconds   time during which at least one bucket's communication was in flight (union of the intervals
                 from the hook's call to its future's completion), mean per step, slowest rank; it may overlap
                 backward compute
  inter_node_bytes_per_step  bytes that left every node on its inter-node link (the veth's tx counter, read by
                 each node's local rank 0 between barriers), summed over nodes, per measured step
  final_loss     MSE on the last measured step, averaged over ranks
  cpu_seconds    CPU time of a rank's process (all threads: autograd, gloo, hook workers) per measured step,
                 mean over ranks; unlike wall time, it barely changes when other work shares the cores
"""
import json
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.common import worker as common_worker
from bench.common.worker import say
from ciuicflow.testing.cluster import ENV_SHAPED, read_node_link_bytes
from ciuicflow.compression import registry

TORCH_HOOKS = ("allreduce", "fp16_compress_hook", "powerSGD_hook")
CIUICFLOW_HOOKS = tuple(registry.METHODS)
# methods that take a rank (name:r)
RANKED = ("powerSGD_hook",) + tuple(n for n, m in registry.METHODS.items() if m.entry.cost.kind == "lowrank")

POWERSGD_NOTE = ("torch powerSGD_hook on gloo: each bucket's future is waited for inside the hook before returning "
                 "(unmodified, its P/Q all-reduces from future callbacks interleave across buckets and crash/hang)")


def parse_method(spec: str):
    """'powerSGD_hook:4' -> ('powerSGD_hook', 4); 'allreduce' -> ('allreduce', None)."""
    name, _, rank = spec.partition(":")
    if name not in TORCH_HOOKS + CIUICFLOW_HOOKS + ("no_comm",):
        raise ValueError(f"unknown method {name!r}")
    if rank and name not in RANKED:
        raise ValueError(f"method {name!r} takes no rank")
    if name in RANKED and not rank:
        rank = "1"
    return name, (int(rank) if rank else None)


def method_label(name, rank):
    return f"{name}_r{rank}" if rank is not None else name


# --------------------------------------------------------------------------- model and data

def mlp_width(params: int, layers: int) -> int:
    # layers square Linear(width, width) layers with bias: layers * (width^2 + width) ~= params
    return max(8, int(round(math.sqrt(params / layers) / 8)) * 8)


def build_model(width, layers, seed):
    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def make_batch(width, batch, seed, rank):
    """Each rank's own batch (a distinct shard), identical for every method: inputs and a fixed teacher's output.

    Every step fits the same batch, so the loss falls steadily within a few steps and final losses of the methods
    are comparable (fresh random batches would bury the progress of ten steps in batch-to-batch noise)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(width, width, generator=gen) / math.sqrt(width)
    gen.manual_seed(seed * 1000 + rank + 1)
    x = torch.randn(batch, width, generator=gen)
    return x, torch.tanh(x @ teacher)


# --------------------------------------------------------------------------- hooks

class CommClock:
    """Intervals from each hook call to the completion of its future, for the current step."""

    def __init__(self):
        self.intervals = []

    def reset(self):
        self.intervals = []

    def busy_seconds(self):
        # union of the intervals: wall time with at least one bucket in flight
        total, end = 0.0, -math.inf
        for s, e in sorted(self.intervals):
            if e > end:
                total += e - max(s, end)
                end = e
        return total

    def wrap(self, hook):
        def timed(state, bucket):
            start = time.perf_counter()
            fut = hook(state, bucket)

            def done(f):
                self.intervals.append((start, time.perf_counter()))
                return f.value()
            return fut.then(done)
        return timed


def no_comm_hook(state, bucket):
    """The floor: hand DDP the local gradient back without communicating."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def waiting(hook):
    """Wait for the bucket's result before returning, so no two buckets' collectives interleave (gloo)."""
    def hook_waited(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return hook_waited


def register(ddp, name, rank, clock):
    """Register method `name` on ddp with timing; returns (state or None, note)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
    if name == "no_comm":
        ddp.register_comm_hook(None, clock.wrap(no_comm_hook))
        return None, "no communication: local gradients only (compute floor)"
    if name == "allreduce":
        ddp.register_comm_hook(None, clock.wrap(default_hooks.allreduce_hook))
        return None, "PyTorch default all-reduce (default_hooks.allreduce_hook, as DDP without a hook)"
    if name == "fp16_compress_hook":
        ddp.register_comm_hook(None, clock.wrap(default_hooks.fp16_compress_hook))
        return None, "PyTorch fp16_compress_hook"
    if name == "powerSGD_hook":
        # compress from step 2 on (the earliest PowerSGD allows with error feedback): inside the warmup
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, clock.wrap(waiting(psgd.powerSGD_hook)))
        return state, POWERSGD_NOTE
    # a ciuicflow hook: ciuicflow.register calls ddp.register_comm_hook; time the hook it registers
    import ciuicflow
    original = ddp.register_comm_hook
    ddp.register_comm_hook = lambda state, hook: original(state, clock.wrap(hook))
    options = {}
    if name != "hierarchical_allreduce":
        options["warmup_steps"] = 2  # compress from step 2, like powerSGD_hook above (default: 10)
    if rank is not None:
        # the rank every bucket is sent at, as powerSGD_hook's (this model trains with Adam, whose
        # buckets would otherwise go at PowerSGD's adaptive_rank, twice the rank)
        options["rank"] = options["adaptive_rank"] = rank
    options.update(as_named(name))
    try:
        state = ciuicflow.register(ddp, name, **options)
    finally:
        del ddp.register_comm_hook
    shown = "".join(f", {k}={v!r}" for k, v in options.items())
    return state, f"ciuicflow.register(model, {name!r}{shown})"


def as_named(method: str) -> dict:
    """Options that make a method send what its name says under this bench's Adam: a 1-bit
    state's default sends an adaptive optimizer's buckets with another codec (int4, or int8:
    docs/hooks.md); this bench measures each codec's
    communication."""
    compressor = registry.method(method).entry.compressor_class()
    return {"adaptive_optimizer": "same"} if getattr(compressor, "adaptive_codecs", None) else {}


def ciuicflow_unavailable(name):
    """None when ciuicflow's hook `name` can be registered here, else why not (same answer on every rank)."""
    try:
        import ciuicflow
        ciuicflow.register  # noqa: B018 - resolves ciuicflow.ddp
        import ciuicflow.ddp.hooks as hooks
        getattr(hooks, name)
        if name != "hierarchical_allreduce":
            import ciuicflow.ops  # noqa: F401 - the compressing hooks need the native ops
    except Exception as exc:  # any import problem means: skip this method, say why
        return f"{type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------- the run

def node_link_delta(before):
    """Bytes this node sent on its link since `before`, summed over nodes (local rank 0 reads, others add 0)."""
    now = read_node_link_bytes() if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None
    sent = 0.0 if now is None or before is None else float(now[0] - before[0])
    total = torch.tensor([sent], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def reduce_scalar(value, op):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def run_method(spec, args, width, data):
    name, rank = parse_method(spec)
    world = dist.get_world_size()
    clock = CommClock()
    model = build_model(width, args.layers, args.seed)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    state, note = register(ddp, name, rank, clock)
    opt = common_worker.make_optimizer(ddp.parameters(), args)
    loss_fn = torch.nn.MSELoss()

    def step(i):
        x, y = data
        clock.reset()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, clock.busy_seconds(), loss.item()

    first_loss = None
    for i in range(args.warmup):
        _, _, loss = step(i)
        first_loss = loss if first_loss is None else first_loss
    if hasattr(state, "reset_stats"):
        state.reset_stats()  # hook_stats then cover the measured steps only
    dist.barrier()
    local_leader = int(os.environ.get("LOCAL_RANK", 0)) == 0
    before = read_node_link_bytes() if local_leader else None
    dist.barrier()
    step_total = comm_total = 0.0
    loss = float("nan")
    cpu_start = time.process_time()
    for i in range(args.warmup, args.warmup + args.steps):
        seconds, comm, loss = step(i)
        step_total += seconds
        comm_total += comm
        first_loss = loss if first_loss is None else first_loss
    cpu = time.process_time() - cpu_start
    dist.barrier()
    inter_bytes = node_link_delta(before)
    measured = read_node_link_bytes() is not None
    record = {
        "method": method_label(name, rank),
        "hook": name,
        "rank": rank,
        "step_seconds": reduce_scalar(step_total / args.steps, dist.ReduceOp.MAX),
        "comm_seconds": reduce_scalar(comm_total / args.steps, dist.ReduceOp.MAX),
        # CPU time of this process (all its threads) per step, mean over ranks: what the step costs the
        # machine's cores, whatever else runs on them
        "cpu_seconds": reduce_scalar(cpu / args.steps, dist.ReduceOp.SUM) / world,
        "inter_node_bytes_per_step": inter_bytes / args.steps if measured else None,
        "first_loss": reduce_scalar(first_loss, dist.ReduceOp.SUM) / world,
        "final_loss": reduce_scalar(loss, dist.ReduceOp.SUM) / world,
        "note": note,
    }
    stats = getattr(state, "stats", None)
    if callable(stats):
        try:
            record["hook_stats"] = json.loads(json.dumps(stats(), default=str))
        except Exception as exc:
            record["hook_stats"] = f"stats() failed: {exc}"
    del ddp, model, opt
    return record


def main(argv=None):
    p = common_worker.parser(__doc__.split("\n")[0], steps=10)
    args = p.parse_args(argv)
    specs = [s for s in args.methods.split(",") if s]
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (DDP rebuilds buckets after step 1; PowerSGD compresses from step 2)")
    for spec in specs:
        parse_method(spec)  # fail early on a typo, before anything starts

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    width = mlp_width(int(args.params), args.layers)
    data = make_batch(width, args.batch, args.seed, rank)

    def described(record):
        record.update(width=width, layers=args.layers, params=args.layers * (width * width + width),
                      batch=args.batch, steps=args.steps, warmup=args.warmup, world_size=dist.get_world_size(),
                      bucket_cap_mb=args.bucket_cap_mb, shaped=os.environ.get(ENV_SHAPED) == "1")
        return record

    for spec in specs:
        name, r = parse_method(spec)
        why = ciuicflow_unavailable(name) if name in CIUICFLOW_HOOKS else None
        if why is not None:
            if rank == 0:
                say(f"[bench] SKIPPED {method_label(name, r)}: ciuicflow hook not available ({why})")
                common_worker.append(args.out, described({"method": method_label(name, r), "hook": name,
                                                          "rank": r, "skipped": why}))
            continue
        if rank == 0:
            say(f"[bench] {method_label(name, r)} ...")
        record = common_worker.run_or_die(run_method, spec, args, width, data)
        if rank == 0:
            common_worker.report(described(record), args.out)
    common_worker.finish(args)


if __name__ == "__main__":
    main()
