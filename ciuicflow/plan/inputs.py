"""What the planner is told: the cluster (``ClusterSpec``) and what is trained on it (``Workload``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ciuicflow.compression.policy import ADAPTIVE_OPTIMIZER_POLICIES
from ciuicflow.compression.registry import SERVED_FAMILIES

SERVER_CODECS = ("", "auto", "same", *SERVED_FAMILIES)  # Workload.server_codec

BACKENDS = ("nccl", "gloo")
OPTIMIZERS = ("sgd", "adam")  # "adam": any adaptive optimizer (Adam, AdamW, ...)


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
    # the collectives' library: gloo's reduce-scatter is an all-reduce of the whole input (twice a
    # ring reduce-scatter's bytes); it matters where the reduce-scatter crosses nodes (FSDP over every rank)
    backend: str = "nccl"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
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
    chunk_size: int | None = None  # elements per scale of the quantising methods (default: each one's)
    # compressors' element-wise work per gradient element; GPU default: ~10 passes of 4 bytes at 2 TB/s
    local_seconds_per_element: float = 2e-11
    matmul_flops: float = 5e13  # float32 matmul flop/s for PowerSGD's factors
    overlap: float = 0.0
    bucket_bytes: float = 25 * 2 ** 20  # DDP's bucket_cap_mb=25: one all-reduce per bucket, in sequence
    # "sgd" or "adam" (any adaptive optimizer): under "adam" the 1-bit methods send another codec
    # (registry Cost.adaptive_family; docs/hooks.md, "Adaptive optimizers")
    optimizer: str = "sgd"
    # under "adam": the 1-bit states' ``adaptive_optimizer`` (auto, int4, int8 or same: what they
    # send those buckets as); "" is their default, auto (compression.policy's
    # ladder, costed at its first rung, int4)
    adaptive_optimizer: str = ""
    # the share of a 1-bit method's chunks that also send values (concentrated windows,
    # compression/outliers.py): 1.0, every chunk, is the upper bound; which windows are
    # concentrated is known only from the data (Gaussian noise has none: 0.0)
    values_share: float = 1.0
    # the 1-bit states' ``server_codec`` where their exchange has two phases (beyond four nodes, or
    # with ``phases`` 2):
    # "" or "auto" is their default (int4), "same" 1 bit, or one of registry.SERVED_FAMILIES
    server_codec: str = ""
    # the quantising states' ``phases``: "auto" (their default), 1 or 2 (QuantizedCompressor)
    phases: str | int = "auto"

    def __post_init__(self):
        if self.params < 1:
            raise ValueError("params must be at least 1")
        if self.accum < 1:
            raise ValueError(f"accum must be >= 1, got {self.accum}")
        if self.compute_seconds < 0 or not 0.0 <= self.overlap <= 1.0:
            raise ValueError("compute_seconds must be >= 0 and overlap within [0, 1]")
        if self.grad_bytes not in (1, 2, 4, 8):
            raise ValueError(f"grad_bytes must be 1, 2, 4 or 8, got {self.grad_bytes}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.adaptive_optimizer not in ("", *ADAPTIVE_OPTIMIZER_POLICIES):
            raise ValueError(f"adaptive_optimizer must be one of {ADAPTIVE_OPTIMIZER_POLICIES}, "
                             f"got {self.adaptive_optimizer!r}")
        if self.server_codec not in SERVER_CODECS:
            raise ValueError(f"server_codec must be one of {SERVER_CODECS[1:]}, got "
                             f"{self.server_codec!r}")
        if self.phases not in ("auto", 1, 2):
            raise ValueError(f"phases must be 'auto', 1 or 2, got {self.phases!r}")
        if not self.bucket_bytes > 0:
            raise ValueError("bucket_bytes must be positive")
        if not 0.0 <= self.values_share <= 1.0:
            raise ValueError(f"values_share must be within [0, 1], got {self.values_share}")
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

