"""The planner (ciuicflow.plan) next to what bench/comm and bench/fsdp measured on the simulated
cluster: the benches' method names and records are read here, never by the library."""
from __future__ import annotations

import math
from dataclasses import asdict

from ciuicflow.compression import registry
from ciuicflow.plan.cost_model import estimate
from ciuicflow.plan.inputs import ClusterSpec, Workload, powersgd_elements
from ciuicflow.plan.methods import HSDP_STRATEGIES, SCATTER_METHODS, STRATEGIES

# bench/comm method -> (strategy, gradient bytes per element on the wire)
BENCH_METHODS = {
    "allreduce": ("flat_ring", 4), "fp16_compress_hook": ("flat_ring", 2),
    "powerSGD_hook": (registry.FAMILIES["powersgd"].methods["flat"], 4),
    registry.FAMILIES["allreduce"].methods["hierarchical"]: ("hierarchical", 4),
    **{name: (name, 4) for name in STRATEGIES[2:]},
}
# bench/fsdp method -> strategy (its 1-D methods: "fsdp" and "fsdp:<method>")
FSDP_BENCH_METHODS = {"hsdp": "fsdp_hsdp",
                      registry.FAMILIES["allreduce"].methods["hierarchical"]: "fsdp_hsdp",
                      **{s.removeprefix("fsdp_"): s for s in HSDP_STRATEGIES[1:]},
                      "fsdp": "fsdp", **{f"fsdp:{name}": f"fsdp_{name}" for name in SCATTER_METHODS}}

TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (with timestamps)


def machine_cluster(machine: dict, rate_bps: float, inter_efficiency: float = TCP_EFFICIENCY) -> ClusterSpec:
    """The ClusterSpec of a simulated cluster: the rate its link was shaped to, the rest as probed
    (``probe_machine`` in bench/comm/worker.py: latency, intra-node bandwidth and latency); its
    benchmarks run gloo."""
    return ClusterSpec(machine["nodes"], machine["ranks_per_node"], machine.get("intra_bw", 1e12), rate_bps / 8,
                       machine.get("intra_alpha", machine["alpha"]), machine["alpha"], inter_efficiency,
                       backend="gloo")


def fit_local_seconds_per_element(measured_seconds: float, strategy: str, cluster: ClusterSpec,
                                  workload: Workload, rank: int | None = None) -> float:
    """The compressors' local seconds per element that makes the model match one measured collective
    (what is left of the measurement after the modelled communication and matmuls)."""
    bare = Workload(**{**asdict(workload), "local_seconds_per_element": 0.0, "compute_seconds": 0.0})
    return max(0.0, (measured_seconds - estimate(strategy, cluster, bare, rank).comm_seconds) / workload.params)


def fit_values_share(inter_bytes_per_rank: float, strategy: str, cluster: ClusterSpec, workload: Workload,
                     rank: int | None = None) -> float:
    """The ``Workload.values_share`` that makes the model's inter-node bytes match what one rank of a
    1-bit collective sent across nodes (its ``Traffic.inter_bytes``): the bytes are linear in the share,
    from the plain signs and scales (0) to values in every chunk (1)."""
    def bytes_at(share):
        w = Workload(**{**asdict(workload), "values_share": share})
        return estimate(strategy, cluster, w, rank).inter_node_bytes_per_node / cluster.gpus_per_node

    low, high = bytes_at(0.0), bytes_at(1.0)
    if high <= low:  # the strategy sends no values
        return 0.0
    return min(1.0, max(0.0, (inter_bytes_per_rank - low) / (high - low)))


def probed_workload(machine: dict, cluster: ClusterSpec, numel: int, key: str = "hierarchical_1bit",
                    strategy: str | None = None, workload: Workload | None = None) -> Workload:
    """``workload`` (default: one of ``numel`` elements) with the ``values_share`` that the probe's
    1-bit collective ``key`` of ``numel`` elements sent (``inter_bytes`` in bench/comm/probe.py's
    output), modelled as ``strategy`` (default: ``key``); unchanged where the probe has no bytes."""
    workload = workload or Workload(params=numel)
    sent = machine.get("inter_bytes", {}).get(str(numel), {}).get(key)
    if sent is None:
        return workload
    share = fit_values_share(sent, strategy or key, cluster, workload)
    return Workload(**{**asdict(workload), "values_share": share})


def calibrate(records, machine: dict) -> list:
    """The model next to bench/comm's measurements (its JSON records of one run, and its machine probe).

    Compute time is the run's own ``no_comm`` step; the inter-node rate is the one the link was shaped to;
    latency, intra-node bandwidth and matmul rate are probed; the compressors' local seconds per element is
    fitted on the probe's hierarchical 1-bit all-reduce (another size, outside DDP). Returns one dict per
    measured method: predicted and measured step seconds and inter-node bytes (all nodes), and the errors."""
    ran, floor, cluster = _floor_and_cluster(records, machine)
    shapes = [(floor["width"], floor["width"])] * floor["layers"]
    local = _probed_local_seconds(machine, cluster)
    out = []
    for r in ran:
        if r["hook"] not in BENCH_METHODS:
            continue
        strategy, grad_bytes = BENCH_METHODS[r["hook"]]
        workload = Workload(params=r["params"], compute_seconds=floor["step_seconds"], grad_bytes=grad_bytes,
                            matrix_shapes=shapes, local_seconds_per_element=local,
                            matmul_flops=machine.get("matmul_flops", 5e9),
                            bucket_bytes=r.get("bucket_cap_mb", 25) * 2 ** 20 * grad_bytes / 4)
        out.append(_row(r, estimate(strategy, cluster, workload, r.get("rank")), local))
    return out


def calibrate_fsdp(records, machine: dict) -> list:
    """The model's FSDP strategies next to bench/fsdp's measurements (its records and machine
    probe), HSDP and over every rank (``fsdp``, ``fsdp:<method>``): as ``calibrate``, with FSDP2's
    parameter groups (one per layer) for the buckets."""
    ran, floor, cluster = _floor_and_cluster(records, machine)
    local, matmul_flops = _probed_fsdp_compute(machine, cluster)
    out = []
    for r in ran:
        strategy = FSDP_BENCH_METHODS.get(r["method"])
        if strategy is None:
            continue
        # what stepped the run (bench/fsdp: Adam, whose groups PowerSGD sends at its
        # adaptive rank) and what the 1-bit states sent them with
        workload = Workload(params=r["params"], compute_seconds=floor["step_seconds"],
                            matrix_shapes=[(r["width"], r["width"])] * r["layers"],
                            local_seconds_per_element=local, matmul_flops=matmul_flops,
                            bucket_bytes=r["params"] * 4 / r["layers"],
                            optimizer=r.get("optimizer", "sgd"),
                            adaptive_optimizer=r.get("adaptive_optimizer", ""))
        row = _row(r, estimate(strategy, cluster, workload, r.get("rank")), local)
        row["matmul_flops"] = matmul_flops
        out.append(row)
    return out


def _probed_fsdp_compute(machine: dict, cluster: ClusterSpec) -> tuple:
    """(the compressors' local seconds per element, PowerSGD's matmul rate) of the FSDP path, fitted on
    the probe's own inter-node reductions of a shard (``cross_node_1bit`` and ``cross_node_powersgd``,
    bench/comm/probe.py): what each measured beyond the modelled inter-node exchange. The matmul rate so
    fitted also carries PowerSGD's element-wise work (error feedback, P Q^T), which a bare matmul probe
    misses. Without those keys: the DDP fit and the probed matmul rate."""
    probed = next(((int(n), t) for n, t in machine.get("sizes", {}).items() if "cross_node_powersgd" in t), None)
    if probed is None or "shard_cols" not in machine:
        return _probed_local_seconds(machine, cluster), machine.get("matmul_flops", 5e9)
    numel, timings = probed
    g, cols, rank = cluster.gpus_per_node, machine["shard_cols"], machine["powersgd_rank"]
    # a workload whose shard is the probed one (FSDP shards each matrix's rows over the node's G ranks)
    bare = Workload(params=numel * g, matrix_shapes=[(numel // cols * g, cols)], local_seconds_per_element=0.0,
                    matmul_flops=math.inf, bucket_bytes=math.inf)
    bare = probed_workload(machine, cluster, numel, "cross_node_1bit", "fsdp_hierarchical_1bit", bare)

    def inter_seconds(strategy):
        return sum(v for k, v in estimate(strategy, cluster, bare, rank).parts.items() if "inter" in k)

    local = max(0.0, timings["cross_node_1bit"] - inter_seconds("fsdp_hierarchical_1bit")) / numel
    matmul = timings["cross_node_powersgd"] - inter_seconds("fsdp_hierarchical_powersgd") - numel * local
    compressed = powersgd_elements(Workload(params=numel, matrix_shapes=[(numel // cols, cols)]), rank)[3]
    # a residual lost in the noise: the matmuls cost nothing measurable (a floor of 0.1 ms keeps it finite)
    return local, 6 * rank * compressed / max(matmul, 1e-4)


def _probed_local_seconds(machine: dict, cluster: ClusterSpec) -> float:
    """The compressors' local seconds per element, fitted on the probe's hierarchical 1-bit
    all-reduce (the key bench/comm/probe.py writes), or 0."""
    local = 0.0
    for numel, timings in machine.get("sizes", {}).items():
        if "hierarchical_1bit" in timings:
            local = fit_local_seconds_per_element(timings["hierarchical_1bit"], "hierarchical_1bit",
                                                  cluster, probed_workload(machine, cluster, int(numel)))
    return local


def _row(r: dict, e, local: float) -> dict:
    measured_bytes = r.get("inter_node_bytes_per_step")
    return {
        "method": r["method"], "strategy": e.name,
        "predicted_step_seconds": e.step_seconds, "measured_step_seconds": r["step_seconds"],
        "step_error": e.step_seconds / r["step_seconds"] - 1,
        "predicted_comm_seconds": e.comm_seconds, "measured_comm_seconds": r.get("comm_seconds"),
        "predicted_inter_node_bytes": e.inter_node_bytes_total, "measured_inter_node_bytes": measured_bytes,
        "bytes_error": (e.inter_node_bytes_total / measured_bytes - 1) if measured_bytes else None,
        "local_seconds_per_element": local,
    }


def _floor_and_cluster(records, machine: dict):
    """(the measured records, the no_comm record, the run's ClusterSpec)."""
    ran = [r for r in records if "step_seconds" in r]
    floor = next((r for r in ran if r["method"] == "no_comm"), None)
    if floor is None:
        raise ValueError("calibration needs the run's no_comm record (the compute time)")
    if not (floor.get("shaped") and floor.get("rate_bps")):
        raise ValueError("calibration needs a run whose inter-node link was shaped (this one was not)")
    return ran, floor, machine_cluster(machine, floor["rate_bps"])

