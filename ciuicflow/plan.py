"""``ciuicflow plan``: an alpha-beta cost model of gradient communication strategies.

For a model size and a cluster (nodes x GPUs per node, intra-node and inter-node bandwidth and latency)
it predicts, per optimizer step, the communication time, the step time and the bytes on each kind of link
for: a flat ring all-reduce, the hierarchical all-reduce, hierarchical + 1-bit, hierarchical + PowerSGD
rank r, and the flat 1-bit and flat PowerSGD variants; then recommends one.

The model (per collective over k members, D bytes, per-member bandwidth b, latency a):
  all-reduce (ring)            2(k-1) a + 2(k-1)/k D / b
  reduce-scatter / all-gather   (k-1) a +  (k-1)/k D / b
  all-to-all (pairwise)         (k-1) a +  (k-1)/k D / b
Inter-node bandwidth is per node and direction (what a node's NICs inject together); the G inter-node
groups of the hierarchical algorithms run at once and share it. A flat ring over N*G ranks in node order
crosses each node boundary once per direction, so each ring step costs max(intra hop, inter hop).
Compression adds local work: ``local_seconds_per_element`` of the gradient for the compressors' element-wise
passes (error feedback, non-finite check, copies, pack/unpack), plus PowerSGD's matmuls (6 r flops per
compressed element) at ``matmul_flops``; a machine parameter, measured by fitting one run (see docs/plan.md).
Inter-node rates are scaled by ``inter_efficiency``, the payload share of the link rate (TCP over 1500-byte
Ethernet frames: 1448/1514).
Step time = accum * compute + communication not hidden (``overlap`` = share of the backward pass,
2/3 of compute, that communication may hide; 0 by default).

    ciuicflow plan --model 7B --nodes 128 --gpus-per-node 8 --intra-bw 600GB/s --inter-bw 200Gbit/s
    ciuicflow plan --params 25e6 --nodes 2 --gpus-per-node 2 --inter-bw 1gbit --compute-seconds 0.4 --json p.json

Python: ``plan(ClusterSpec(...), Workload(...))`` returns ``Estimate`` objects; ``calibrate(records)`` puts
the model next to what bench/comm.py measured.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

STRATEGIES = ("flat_ring", "hierarchical", "hierarchical_1bit", "hierarchical_powersgd", "onebit", "powersgd")
EXACT_STRATEGIES = ("flat_ring", "hierarchical")
RANKED = ("hierarchical_powersgd", "powersgd")

# bench/comm.py method -> (strategy, gradient bytes per element on the wire)
BENCH_METHODS = {
    "allreduce": ("flat_ring", 4), "fp16_compress_hook": ("flat_ring", 2), "powerSGD_hook": ("powersgd", 4),
    "hierarchical_allreduce": ("hierarchical", 4), "hierarchical_1bit": ("hierarchical_1bit", 4),
    "hierarchical_powersgd": ("hierarchical_powersgd", 4), "onebit": ("onebit", 4), "powersgd": ("powersgd", 4),
}

ONEBIT_CHUNK = 256  # elements per scale of the 1-bit hooks (ciuicflow.hooks.ONEBIT_CHUNK_SIZE)
POWERSGD_RANK = 16  # the PowerSGD hooks' default rank (ciuicflow.hooks.POWERSGD_RANK)


# ----------------------------------------------------------------------------------------- units

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_count(value) -> float:
    """Parameters: 7e9, "7B", "67b", "25M", "350k"."""
    if isinstance(value, (int, float)):
        count = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", str(value))
        if match is None:
            raise ValueError(f"cannot parse a parameter count from {value!r}: use e.g. 7B, 67B, 25M, 7e9")
        count = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    if not count >= 1:
        raise ValueError(f"parameter count must be at least 1, got {value!r}")
    return count


def parse_bandwidth(value) -> float:
    """Bytes/s from "600GB/s", "200Gbit/s", "200Gbit", "100gbps", "1.5e9" (a plain number is bytes/s).

    Units with "bit"/"bps" or a lower-case "b" (Gb, Mb) are bits; "B"/"byte" are bytes."""
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)"
                             r"(bits?|bps|b|B|bytes?|Bps)?(/s|ps)?\s*", str(value))
        if match is None:
            raise ValueError(f"cannot parse a bandwidth from {value!r}: use e.g. 600GB/s, 200Gbit/s, 1gbit")
        number, prefix, binary, unit, _ = match.groups()
        scale = (1024 ** " kmgtp".index(prefix.lower())) if binary else _SI[prefix.lower()]
        bits = unit is not None and (unit.startswith("bit") or unit in ("bps", "b"))
        rate = float(number) * scale / (8 if bits else 1)
    if not rate > 0:
        raise ValueError(f"bandwidth must be positive, got {value!r}")
    return rate


def parse_seconds(value) -> float:
    """Seconds from "5us", "5µs", "1.5ms", "2ns", "0.3s", "3e-6" (a plain number is seconds)."""
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*", str(value))
        if match is None:
            raise ValueError(f"cannot parse a time from {value!r}: use e.g. 5us, 1.5ms, 0.3s")
        seconds = float(match.group(1)) * {None: 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6,
                                             "ns": 1e-9}[match.group(2)]
    if seconds < 0:
        raise ValueError(f"time must not be negative, got {value!r}")
    return seconds


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


# ----------------------------------------------------------------------------------------- inputs

@dataclass
class ClusterSpec:
    """The machines. Bandwidths in bytes/s: intra per GPU link, inter per node and direction."""
    nodes: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 5e-6
    inter_latency: float = 15e-6
    inter_efficiency: float = 1.0  # payload bytes per byte of link rate

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"need at least 1 node and 1 GPU per node, got {self.nodes} x {self.gpus_per_node}")
        if not (self.intra_bw > 0 and self.inter_bw > 0):
            raise ValueError("bandwidths must be positive")
        if self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError("latencies must not be negative")
        if not 0 < self.inter_efficiency <= 1:
            raise ValueError(f"inter_efficiency must be within (0, 1], got {self.inter_efficiency}")

    @property
    def inter_goodput(self) -> float:
        return self.inter_bw * self.inter_efficiency

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Workload:
    """What is trained. ``compute_seconds``: forward + backward of one micro-batch on one GPU.

    ``matrix_shapes`` (rows, cols) of the gradient matrices, for PowerSGD; without them a transformer of
    hidden size ``hidden`` is assumed (default: estimated from the size)."""
    params: float
    compute_seconds: float = 0.0
    accum: int = 1
    grad_bytes: int = 4
    hidden: int | None = None
    matrix_shapes: list | None = None
    onebit_chunk: int = ONEBIT_CHUNK
    # compressors' element-wise work per gradient element; GPU default: ~10 passes of 4 bytes at 2 TB/s
    local_seconds_per_element: float = 2e-11
    matmul_flops: float = 5e13  # float32 matmul flop/s for PowerSGD's factors
    overlap: float = 0.0
    bucket_bytes: float = 25 * 2 ** 20  # DDP's bucket_cap_mb=25: one all-reduce per bucket, in sequence

    def __post_init__(self):
        if self.params < 1:
            raise ValueError("params must be at least 1")
        if self.accum < 1:
            raise ValueError(f"accum must be >= 1, got {self.accum}")
        if self.compute_seconds < 0 or not 0.0 <= self.overlap <= 1.0:
            raise ValueError("compute_seconds must be >= 0 and overlap within [0, 1]")
        if self.grad_bytes not in (1, 2, 4, 8):
            raise ValueError(f"grad_bytes must be 1, 2, 4 or 8, got {self.grad_bytes}")
        if not self.bucket_bytes > 0:
            raise ValueError("bucket_bytes must be positive")
        if not (self.local_seconds_per_element >= 0 and self.matmul_flops > 0):
            raise ValueError("local_seconds_per_element must be >= 0 and matmul_flops positive")

    @property
    def buckets(self) -> int:
        return max(1, math.ceil(self.params * self.grad_bytes / self.bucket_bytes))

    @property
    def hidden_size(self) -> int:
        if self.hidden:
            return int(self.hidden)
        # a transformer has ~12 L h^2 parameters with h/L ~ 128: h ~ (128 P / 12)^(1/3)
        return max(128, int(round((self.params * 128 / 12) ** (1 / 3) / 128)) * 128)


def compute_seconds_from_flops(params: float, tokens: float, gpu_flops: float, mfu: float = 0.4) -> float:
    """Forward + backward time of one micro-batch of ``tokens`` tokens: 6 flops per parameter and token."""
    if tokens <= 0 or gpu_flops <= 0 or not 0 < mfu <= 1:
        raise ValueError("tokens and gpu_flops must be positive and mfu within (0, 1]")
    return 6.0 * params * tokens / (gpu_flops * mfu)


def powersgd_elements(workload: Workload, rank: int, min_compression_rate: float = 2.0) -> tuple:
    """(P elements, Q elements, elements sent uncompressed, elements inside compressed matrices) per step.

    As PyTorch's PowerSGD and ciuicflow's: a matrix is compressed when (rows + cols) r * 2 < rows cols."""
    if workload.matrix_shapes:
        p = q = compressed = 0
        for rows, cols in workload.matrix_shapes:
            r = min(rank, rows, cols)
            if (rows + cols) * r * min_compression_rate < rows * cols:
                p, q, compressed = p + rows * r, q + cols * r, compressed + rows * cols
        return p, q, max(0.0, workload.params - compressed), compressed
    h = workload.hidden_size
    # per layer: 4 h x h attention matrices and h x 4h, 4h x h MLP matrices (12 h^2 params): P and Q 9 h r each
    factors = workload.params * 1.5 * rank / h
    return factors / 2, factors / 2, 0.0, workload.params


# ----------------------------------------------------------------------------------------- the model

@dataclass
class Estimate:
    strategy: str
    rank: int | None
    comm_seconds: float
    step_seconds: float
    compute_seconds: float
    inter_node_bytes_per_node: float  # sent by each node on its inter-node link per step
    intra_node_bytes_per_gpu: float  # sent by each GPU to GPUs of its own node per step
    inter_node_bytes_total: float
    compress_seconds: float = 0.0
    parts: dict = field(default_factory=dict)  # seconds of each phase, all buckets
    buckets: int = 1

    @property
    def name(self) -> str:
        return f"{self.strategy}_r{self.rank}" if self.rank is not None else self.strategy

    def as_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


def _ring_allreduce(k, nbytes, bw, lat):
    return 0.0 if k <= 1 else 2 * (k - 1) * lat + 2 * (k - 1) / k * nbytes / bw


def _scatter_or_gather(k, nbytes, bw, lat):
    return 0.0 if k <= 1 else (k - 1) * lat + (k - 1) / k * nbytes / bw


def _flat_ring(c: ClusterSpec, nbytes: float) -> tuple:
    """(seconds, inter bytes per node, intra bytes per GPU) of a ring all-reduce over all ranks in node order."""
    p, g, n = c.world, c.gpus_per_node, c.nodes
    if p == 1:
        return 0.0, 0.0, 0.0
    chunk = nbytes / p
    hops = []
    if n > 1:
        hops.append(c.inter_latency + chunk / c.inter_goodput)
    if g > 1:
        hops.append(c.intra_latency + chunk / c.intra_bw)
    seconds = 2 * (p - 1) * max(hops)
    sent = 2 * (p - 1) / p * nbytes
    return seconds, (sent if n > 1 else 0.0), (sent * (g - 1) / g if n > 1 else sent)


def _hierarchical(c: ClusterSpec, nbytes: float, parts=None, tag="") -> tuple:
    """Intra reduce-scatter, inter all-reduce of the shards (G groups sharing each node's link), intra
    all-gather. Returns (seconds, inter bytes per node, intra bytes per GPU)."""
    g, n = c.gpus_per_node, c.nodes
    if n == 1 or g == 1:  # one level only: the flat ring is the hierarchical algorithm
        return _flat_ring(c, nbytes)
    rs = _scatter_or_gather(g, nbytes, c.intra_bw, c.intra_latency)
    inter = _ring_allreduce(n, nbytes / g, c.inter_goodput / g, c.inter_latency)
    ag = rs
    if parts is not None:
        parts.update({f"{tag}intra_reduce_scatter": rs, f"{tag}inter_allreduce": inter, f"{tag}intra_all_gather": ag})
    return rs + inter + ag, 2 * (n - 1) / n * nbytes, 2 * (g - 1) / g * nbytes


def estimate(strategy: str, cluster: ClusterSpec, workload: Workload, rank: int | None = None) -> Estimate:
    """Predicted communication and step time of one strategy (rank: PowerSGD's, for the ranked ones)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    if strategy in RANKED:
        rank = int(rank or POWERSGD_RANK)
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
    else:
        rank = None
    c = cluster
    # DDP reduces the gradient bucket by bucket, one after the other: model one bucket, count it `buckets` times
    buckets = workload.buckets
    w = Workload(**{**asdict(workload), "params": workload.params / buckets, "bucket_bytes": math.inf,
                    "hidden": workload.hidden_size})
    g, n, p = c.gpus_per_node, c.nodes, c.world
    nbytes = w.params * w.grad_bytes
    parts: dict = {}
    compress = 0.0
    if p == 1:
        comm, inter, intra = 0.0, 0.0, 0.0
    elif strategy == "flat_ring":
        comm, inter, intra = _flat_ring(c, nbytes)
        parts["ring"] = comm
    elif strategy == "hierarchical":
        comm, inter, intra = _hierarchical(c, nbytes, parts=parts)
    elif strategy in ("hierarchical_1bit", "onebit"):
        comm, inter, intra, compress = _onebit(c, w, strategy == "hierarchical_1bit", parts)
    else:
        # each bucket holds its share of the matrices
        elements = [e / buckets for e in powersgd_elements(workload, rank)]
        comm, inter, intra, compress = _powersgd(c, w, rank, elements, strategy == "hierarchical_powersgd", parts)
    comm = (comm + compress) * buckets
    inter, intra, compress = inter * buckets, intra * buckets, compress * buckets
    parts = {k: v * buckets for k, v in parts.items()}
    compute = w.accum * w.compute_seconds
    hidden = min(comm, w.overlap * compute * 2 / 3 / w.accum)  # only the last micro-batch's backward overlaps
    return Estimate(strategy, rank, comm, compute + comm - hidden, compute, inter, intra, inter * n, compress,
                    parts, buckets)


def _onebit(c: ClusterSpec, w: Workload, hierarchical: bool, parts: dict) -> tuple:
    g, n, p = c.gpus_per_node, c.nodes, c.world
    elems = w.params
    per_elem = 1 / 8 + 4 / w.onebit_chunk  # sign bits + one float32 scale per chunk
    if hierarchical and n > 1 and g > 1:
        nbytes = elems * w.grad_bytes
        rs = _scatter_or_gather(g, nbytes, c.intra_bw, c.intra_latency)
        shard = elems / g
        # all-to-all then all-gather of the compressed shard among N nodes; G groups share the link
        phase = _scatter_or_gather(n, shard * per_elem, c.inter_goodput / g, c.inter_latency)
        compress = elems * w.local_seconds_per_element
        parts.update(intra_reduce_scatter=rs, inter_all_to_all=phase, inter_all_gather=phase, intra_all_gather=rs,
                     compress=compress)
        inter = 2 * (n - 1) / n * elems * per_elem
        intra = 2 * (g - 1) / g * nbytes
        return 2 * rs + 2 * phase, inter, intra, compress
    if hierarchical and n == 1:  # nothing crosses a node: exact
        comm, inter, intra = _flat_ring(c, elems * w.grad_bytes)
        parts["ring"] = comm
        return comm, inter, intra, 0.0
    # flat over all p ranks. Phase 1, pairwise all-to-all: each rank sends (p-1)/p of the compressed tensor,
    # the off-node share (p-G)/(p-1) of it over its node's link (G ranks' worth per node), the rest over NVLink.
    dc = elems * per_elem
    a2a_inter = g * (p - g) / p * dc
    lat = (p - 1) * (c.inter_latency if n > 1 else c.intra_latency)
    a2a = lat + max(a2a_inter / c.inter_goodput if n > 1 else 0.0, (g - 1) / p * dc / c.intra_bw)
    # phase 2, ring all-gather of the served segments (as gloo and NCCL run it): one edge per node crosses
    ag = _scatter_or_gather(p, dc, min(c.inter_goodput, c.intra_bw) if n > 1 else c.intra_bw,
                            c.inter_latency if n > 1 else c.intra_latency)
    compress = elems * w.local_seconds_per_element
    parts.update(all_to_all=a2a, all_gather=ag, compress=compress)
    ag_inter = (p - 1) / p * dc if n > 1 else 0.0
    return a2a + ag, a2a_inter + ag_inter, (g - 1) / p * dc + (p - 1) / p * dc * (g - 1) / g, compress


def _powersgd(c: ClusterSpec, w: Workload, rank: int, elements, hierarchical: bool, parts: dict) -> tuple:
    p_elems, q_elems, exact, compressed = elements
    # two all-reduces: P with the uncompressed values, then Q (in the gradients' dtype)
    first = (p_elems + exact) * w.grad_bytes
    second = q_elems * w.grad_bytes
    if hierarchical and c.nodes > 1:
        t1, i1, a1 = _hierarchical(c, first, parts=parts, tag="P_")
        t2, i2, a2 = _hierarchical(c, second, parts=parts, tag="Q_")
    else:
        t1, i1, a1 = _flat_ring(c, first)
        t2, i2, a2 = _flat_ring(c, second)
        parts.update(P_ring=t1, Q_ring=t2)
    # every rank multiplies its whole gradient: P = M Q, Q = M^T P, M ~ P Q^T (2 r flops/element each),
    # plus element-wise work (M + error, non-finite check, copy out, new error)
    compress = 6 * rank * compressed / w.matmul_flops + w.params * w.local_seconds_per_element
    parts["compress"] = compress
    return t1 + t2, i1 + i2, a1 + a2, compress


def plan(cluster: ClusterSpec, workload: Workload, strategies=None, ranks=(1, 4)) -> list:
    """Estimates of every strategy (PowerSGD ones at each rank in ``ranks``), fastest first."""
    out = []
    for s in strategies or STRATEGIES:
        for r in (ranks if s in RANKED else (None,)):
            out.append(estimate(s, cluster, workload, r))
    return sorted(out, key=lambda e: e.step_seconds)


def recommend(estimates) -> tuple:
    """(the Estimate to use, why). Exact strategies win unless compression saves at least 10% of the step."""
    best = min(estimates, key=lambda e: e.step_seconds)
    exact = [e for e in estimates if e.strategy in EXACT_STRATEGIES]
    best_exact = min(exact, key=lambda e: e.step_seconds) if exact else None
    if best_exact is None or best is best_exact:
        return best, "fastest, and exact"
    if best.step_seconds >= 0.9 * best_exact.step_seconds:
        return best_exact, (f"exact, within 10% of the fastest ({best.name}, "
                            f"{best.step_seconds / best_exact.step_seconds:.2f}x its step time)")
    return best, (f"{best_exact.step_seconds / best.step_seconds:.2f}x faster per step than the best exact "
                  f"strategy ({best_exact.name}); compression changes the update: error feedback keeps it "
                  f"converging, but check accuracy on your model")


# ----------------------------------------------------------------------------------------- calibration

TCP_EFFICIENCY = 1448 / 1514  # TCP payload per Ethernet frame at MTU 1500 (with timestamps)


def machine_cluster(machine: dict, rate_bps: float, inter_efficiency: float = TCP_EFFICIENCY) -> ClusterSpec:
    """The ClusterSpec of a simulated cluster: the rate its link was shaped to, the rest as probed
    (``probe_machine`` in bench/comm_worker.py: latency, intra-node bandwidth and latency)."""
    return ClusterSpec(machine["nodes"], machine["ranks_per_node"], machine.get("intra_bw", 1e12), rate_bps / 8,
                       machine.get("intra_alpha", machine["alpha"]), machine["alpha"], inter_efficiency)


def fit_local_seconds_per_element(measured_seconds: float, strategy: str, cluster: ClusterSpec,
                                  workload: Workload, rank: int | None = None) -> float:
    """The compressors' local seconds per element that makes the model match one measured collective
    (what is left of the measurement after the modelled communication and matmuls)."""
    bare = Workload(**{**asdict(workload), "local_seconds_per_element": 0.0, "compute_seconds": 0.0})
    return max(0.0, (measured_seconds - estimate(strategy, cluster, bare, rank).comm_seconds) / workload.params)


def calibrate(records, machine: dict) -> list:
    """The model next to bench/comm.py's measurements (its JSON records of one run, and its machine probe).

    Compute time is the run's own ``no_comm`` step; the inter-node rate is the one the link was shaped to;
    latency, intra-node bandwidth and matmul rate are probed; the compressors' local seconds per element is
    fitted on the probe's hierarchical 1-bit all-reduce (another size, outside DDP). Returns one dict per
    measured method: predicted and measured step seconds and inter-node bytes (all nodes), and the errors."""
    ran = [r for r in records if "step_seconds" in r]
    floor = next((r for r in ran if r["method"] == "no_comm"), None)
    if floor is None:
        raise ValueError("calibration needs the run's no_comm record (the compute time)")
    if not (floor.get("shaped") and floor.get("rate_bps")):
        raise ValueError("calibration needs a run whose inter-node link was shaped (this one was not)")
    cluster = machine_cluster(machine, floor["rate_bps"])
    shapes = [(floor["width"], floor["width"])] * floor["layers"]
    local = 0.0
    for numel, timings in machine.get("sizes", {}).items():
        if "hierarchical_1bit" in timings:
            local = fit_local_seconds_per_element(timings["hierarchical_1bit"], "hierarchical_1bit", cluster,
                                                  Workload(params=int(numel)))
    out = []
    for r in ran:
        if r["hook"] not in BENCH_METHODS:
            continue
        strategy, grad_bytes = BENCH_METHODS[r["hook"]]
        workload = Workload(params=r["params"], compute_seconds=floor["step_seconds"], grad_bytes=grad_bytes,
                            matrix_shapes=shapes, local_seconds_per_element=local,
                            matmul_flops=machine.get("matmul_flops", 5e9),
                            bucket_bytes=r.get("bucket_cap_mb", 25) * 2 ** 20 * grad_bytes / 4)
        e = estimate(strategy, cluster, workload, r.get("rank"))
        measured_bytes = r.get("inter_node_bytes_per_step")
        out.append({
            "method": r["method"], "strategy": e.name,
            "predicted_step_seconds": e.step_seconds, "measured_step_seconds": r["step_seconds"],
            "step_error": e.step_seconds / r["step_seconds"] - 1,
            "predicted_comm_seconds": e.comm_seconds, "measured_comm_seconds": r["comm_seconds"],
            "predicted_inter_node_bytes": e.inter_node_bytes_total, "measured_inter_node_bytes": measured_bytes,
            "bytes_error": (e.inter_node_bytes_total / measured_bytes - 1) if measured_bytes else None,
            "local_seconds_per_element": local,
        })
    return out


# ----------------------------------------------------------------------------------------- CLI

def add_arguments(parser) -> None:
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--model", help="model size, e.g. 7B, 67B, 350M")
    size.add_argument("--params", help="model size in parameters, e.g. 7e9 (same as --model)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--intra-bw", default="600GB/s", help="per-GPU intra-node bandwidth (default 600GB/s)")
    parser.add_argument("--inter-bw", default="200Gbit/s",
                        help="inter-node bandwidth per node and direction (all its NICs; default 200Gbit/s)")
    parser.add_argument("--intra-latency", default="5us")
    parser.add_argument("--inter-latency", default="15us")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation steps per optimizer step")
    parser.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element (4: fp32, 2: bf16)")
    compute = parser.add_mutually_exclusive_group()
    compute.add_argument("--compute-seconds", type=float, help="forward+backward seconds of one micro-batch")
    compute.add_argument("--tokens-per-gpu", type=float, default=4096,
                         help="tokens per GPU per micro-batch, for the FLOPs estimate (default 4096)")
    parser.add_argument("--gpu-tflops", type=float, default=989.0, help="peak TFLOP/s per GPU (default: H100 bf16)")
    parser.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default 0.4)")
    parser.add_argument("--ranks", default="1,4", help="PowerSGD ranks to consider (default 1,4)")
    parser.add_argument("--hidden", type=int, help="hidden size, for PowerSGD (default: estimated from size)")
    parser.add_argument("--local-ns-per-element", type=float, default=0.02,
                        help="compressors' element-wise work, ns per gradient element (default 0.02: GPU)")
    parser.add_argument("--matmul-tflops", type=float, default=50.0, help="float32 TFLOP/s for PowerSGD's matmuls")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDP bucket size in MiB: one all-reduce (and its latency) per bucket (default 25)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="share of the backward pass communication can hide (0..1, default 0)")
    parser.add_argument("--strategies", help=f"comma-separated subset of {','.join(STRATEGIES)}")
    parser.add_argument("--json", metavar="PATH", help="also write the estimates as JSON")


def _build(args):
    params = parse_count(args.model if args.model is not None else args.params)
    cluster = ClusterSpec(args.nodes, args.gpus_per_node, parse_bandwidth(args.intra_bw),
                          parse_bandwidth(args.inter_bw), parse_seconds(args.intra_latency),
                          parse_seconds(args.inter_latency))
    if args.compute_seconds is not None:
        compute, source = args.compute_seconds, "given"
    else:
        compute = compute_seconds_from_flops(params, args.tokens_per_gpu, args.gpu_tflops * 1e12, args.mfu)
        source = (f"6 x params x {args.tokens_per_gpu:g} tokens / ({args.gpu_tflops:g} TFLOP/s x "
                  f"MFU {args.mfu:g})")
    workload = Workload(params, compute, args.accum, args.grad_bytes, args.hidden,
                        local_seconds_per_element=args.local_ns_per_element * 1e-9,
                        matmul_flops=args.matmul_tflops * 1e12, overlap=args.overlap,
                        bucket_bytes=args.bucket_mb * 2 ** 20)
    ranks = tuple(int(r) for r in str(args.ranks).split(",") if r.strip())
    strategies = None
    if args.strategies:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from {STRATEGIES}")
    return cluster, workload, ranks, strategies, source


def table(estimates, baseline) -> str:
    rows = ["| strategy | comm / step | step time | comm share | inter-node per node | intra-node per GPU | "
            "vs flat_ring |", "|---|---:|---:|---:|---:|---:|---:|"]
    for e in estimates:
        share = e.comm_seconds / e.step_seconds if e.step_seconds else 0.0
        speed = f"{baseline.step_seconds / e.step_seconds:.2f}x" if baseline and e.step_seconds else "n/a"
        rows.append(f"| {e.name} | {_fmt_s(e.comm_seconds)} | {_fmt_s(e.step_seconds)} | {share:.0%} | "
                    f"{_fmt_bytes(e.inter_node_bytes_per_node)} | {_fmt_bytes(e.intra_node_bytes_per_gpu)} | "
                    f"{speed} |")
    return "\n".join(rows)


def run(args) -> int:
    import json
    import sys

    try:
        cluster, workload, ranks, strategies, source = _build(args)
        estimates = plan(cluster, workload, strategies, ranks)
    except ValueError as exc:
        print(f"ciuicflow plan: error: {exc}", file=sys.stderr)
        return 2
    best, why = recommend(estimates)
    baseline = next((e for e in estimates if e.strategy == "flat_ring"), None)
    print(f"Model {workload.params / 1e9:.3g}B parameters ({workload.grad_bytes}-byte gradients, "
          f"{_fmt_bytes(workload.params * workload.grad_bytes)} per all-reduce), hidden ~{workload.hidden_size}; "
          f"{cluster.nodes} nodes x {cluster.gpus_per_node} GPUs; intra {_fmt_bytes(cluster.intra_bw)}/s "
          f"{_fmt_s(cluster.intra_latency)}, inter {_fmt_bytes(cluster.inter_bw)}/s per node "
          f"{_fmt_s(cluster.inter_latency)}")
    print(f"Compute {_fmt_s(workload.compute_seconds)} per micro-batch ({source}), accum {workload.accum}, "
          f"overlap {workload.overlap:g}")
    print()
    print(table(estimates, baseline))
    print()
    print(f"Recommended: {best.name} - {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": asdict(cluster), "workload": {k: v for k, v in asdict(workload).items()},
                       "compute_source": source, "estimates": [e.as_dict() for e in estimates],
                       "recommended": best.name, "reason": why}, f, indent=1)
    return 0
