"""The machine probe of bench/comm's workers (for the planner): latency, intra-node bandwidth and
the collectives ciuicflow.plan models, timed with every rank busy at once. Runs inside a worker
(torch.distributed initialised, torchrun's node variables set)."""
import os
import statistics
import time

import torch
import torch.distributed as dist


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _slowest(seconds):
    """A collective lasts as long as its slowest rank."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _intra_fit(seconds: dict, local: int) -> dict:
    """intra_bw and intra_alpha from the node's reduce + gather at two sizes: t = 2 (L-1) alpha +
    2 (L-1)/L * bytes / bw, the planner's reduce-scatter + all-gather."""
    points = sorted((key[1], t) for key, t in seconds.items() if isinstance(key, tuple) and key[0] == "intra")
    (small, t_small), (big, t_big) = points

    def moved(numel):
        return 2 * (local - 1) / local * numel * 4

    per_byte = (t_big - t_small) / (moved(big) - moved(small))
    fixed = t_small - per_byte * moved(small)
    if per_byte <= 0 or fixed < 0:  # noise beat the difference: all of it per byte, no fixed cost
        per_byte, fixed = t_big / moved(big), 0.0
    return {"intra_bw": 1 / per_byte, "intra_alpha": fixed / (2 * (local - 1))}


def _cross_node_tasks(tasks, sent, numel, local, shard_cols, powersgd_rank):
    """The FSDP path's own inter-node reduction (ciuicflow/fsdp/state.py): each rank's shard reduced
    flat with the ranks of the same local index on the other nodes, every group at once (they share
    the node's link), by the 1-bit and the PowerSGD compressors; ``numel`` elements viewed as rows
    of ``shard_cols`` (PowerSGD's matrix)."""
    import ciuicflow
    from ciuicflow.compression.powersgd import PowerSGDMemory, powersgd_all_reduce
    from ciuicflow.collectives.primitives import Traffic
    from ciuicflow.compression.quantized import QuantizedErrors

    world = dist.get_world_size()
    groups = [dist.new_group(list(range(i, world, local))) for i in range(local)]  # every rank, in order
    cross = ciuicflow.Topology.detect(groups[dist.get_rank() % local])
    rows = max(1, numel // shard_cols)
    y = torch.randn(rows, shard_cols)
    errors, memory, traffic = QuantizedErrors(), PowerSGDMemory(), Traffic()
    onebit = lambda t=None: ciuicflow.onebit_all_reduce(y.view(-1), errors, cross,  # noqa: E731
                                                        hierarchical=False, traffic=t)
    powersgd = lambda: powersgd_all_reduce(y, memory, cross, hierarchical=False,  # noqa: E731
                                           rank=powersgd_rank)
    onebit(), powersgd()  # buffers, plans, the warm-start Q
    tasks[(y.numel(), "cross_node_1bit")] = lambda: onebit(traffic)
    sent[(y.numel(), "cross_node_1bit")] = traffic
    tasks[(y.numel(), "cross_node_powersgd")] = powersgd


def probe_machine(numels, repeat=5, intra_path="auto", shard_cols=None, powersgd_rank=16):
    """What the planner needs to know about this machine, measured with every rank busy at once:
    latency (a one-element all-reduce), intra-node bandwidth and latency (the node's reduce and gather at two
    sizes, inside each node at the same time),
    float32 matmul rate (PowerSGD-shaped), and the time of a flat, a hierarchical and a hierarchical 1-bit
    all-reduce of each size in ``numels`` (the last two need ciuicflow). The measurements take turns, round
    after round, and each is the median of its rounds, so a change of load on a shared machine affects all of
    them alike. ``intra_path="gloo"`` measures the node with gloo's reduce-scatter and all-gather, the pair
    FSDP2 runs, even where ciuicflow would use shared memory. ``shard_cols``: also time the FSDP path's
    inter-node reductions of a ``max(numels)``-element shard (1-bit and PowerSGD at ``powersgd_rank``,
    the shard a matrix of that many columns), keys ``cross_node_1bit`` and ``cross_node_powersgd``, and
    record ``shard_cols`` and ``powersgd_rank``. ``inter_bytes``: what each 1-bit collective sent
    across nodes per call, one rank's (which chunks also send values depends on the data: the
    planner's ``Workload.values_share``, ``plan.probed_workload``). Collective; returns a dict."""
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // local
    groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
    mine = groups[dist.get_rank() // local]
    out = {"nodes": nodes, "ranks_per_node": local, "sizes": {}}
    small = torch.zeros(1)
    for _ in range(3):
        dist.all_reduce(small)
    out["alpha"] = _slowest(statistics.median(_timed(lambda: dist.all_reduce(small)) for _ in range(15))) \
        / (2 * (world - 1))

    tasks = {}  # name -> what to time
    sent = {}  # name -> its Traffic (bytes sent by this rank over every timed call)
    x = torch.randn(max(numels))
    a, q = torch.randn(1024, 1024), torch.randn(1024, 4)
    tasks["matmul"] = lambda: [a @ q for _ in range(20)]
    try:
        import ciuicflow
        from ciuicflow.collectives import node_shm
        from ciuicflow.collectives.primitives import Traffic
        from ciuicflow.compression.quantized import QuantizedErrors
        topology = ciuicflow.Topology.detect()
    except Exception as exc:  # the exact ring can still be measured
        out["ciuicflow_error"] = f"{type(exc).__name__}: {exc}"
        topology = None
    if local > 1:
        # Intra-node bandwidth as the hierarchical collectives get it: through the node's shared
        # memory where ciuicflow uses it for CPU tensors, else gloo's all-reduce inside the node.
        segment = node_shm.node_segment(topology) if topology is not None and topology.hierarchical \
            and intra_path != "gloo" else None
        out["intra_path"] = "shared_memory" if segment is not None else "gloo"
        # two sizes, so that the fixed cost per call (barriers, Python) and the cost per byte separate
        for size in (x.numel() // 2, x.numel()):
            xs = x[:size]
            if segment is not None:
                shard_len = -(-size // local)
                tasks[("intra", size)] = lambda xs=xs, s=shard_len: (segment.node_sum(xs, s, False),
                                                                     segment.gather(xs, s))
            elif intra_path == "gloo":  # FSDP2's own pair: a reduce-scatter and an all-gather
                xs = x[:size // local * local]
                shard = torch.empty(size // local)
                tasks[("intra", size)] = lambda xs=xs, sh=shard: (
                    dist.reduce_scatter_tensor(sh, xs, group=mine),
                    dist.all_gather_into_tensor(xs, sh, group=mine))
            else:
                tasks[("intra", size)] = lambda xs=xs: dist.all_reduce(xs, group=mine)
    for n in numels:
        y = torch.randn(n)
        tasks[(n, "flat_ring")] = lambda y=y: dist.all_reduce(y)
        if topology is not None:
            errors, traffic = QuantizedErrors(), Traffic()
            ciuicflow.onebit_all_reduce(y, errors, topology, hierarchical=True)  # allocates its buffers
            tasks[(n, "hierarchical")] = lambda y=y: ciuicflow.hierarchical_all_reduce(y, topology)
            tasks[(n, "hierarchical_1bit")] = lambda y=y, e=errors, t=traffic: ciuicflow.onebit_all_reduce(
                y, e, topology, hierarchical=True, traffic=t)
            sent[(n, "hierarchical_1bit")] = traffic
    if shard_cols and topology is not None and nodes > 1:
        _cross_node_tasks(tasks, sent, max(numels), local, shard_cols, powersgd_rank)
        out.update(shard_cols=shard_cols, powersgd_rank=powersgd_rank)
    times = {name: [] for name in tasks}
    for _ in range(repeat):
        for name, fn in tasks.items():
            times[name].append(_timed(fn))
    seconds = {name: _slowest(statistics.median(ts)) for name, ts in times.items()}

    if local > 1:
        out.update(_intra_fit(seconds, local))
    out["matmul_flops"] = 2 * 1024 * 1024 * 4 * 20 / seconds["matmul"]
    for name, value in seconds.items():
        if isinstance(name, tuple) and name[0] != "intra":
            out["sizes"].setdefault(str(name[0]), {})[name[1]] = value
    # inter-node bytes per call (the 1-bit chunks that send values depend on the data: the planner's
    # Workload.values_share), this rank's, as the model counts them per rank
    for (numel, name), traffic in sent.items():
        out.setdefault("inter_bytes", {}).setdefault(str(numel), {})[name] = traffic.inter_bytes / repeat
    return out


