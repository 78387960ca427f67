"""``ciuicflow plan``: an alpha-beta cost model of gradient communication strategies.

For a model size and a cluster (nodes x GPUs per node, intra-node and inter-node bandwidth and latency)
it predicts, per optimizer step, the communication time, the step time and the bytes on each kind of link
for: a flat ring all-reduce, the hierarchical all-reduce, hierarchical + 1-bit, hierarchical + PowerSGD
rank r, and the flat 1-bit and flat PowerSGD variants; with ``--fsdp``, for FSDP2 sharded inside the node
(HSDP, and ciuicflow.fsdp's hierarchical methods) and over every rank (FSDP2's reduce-scatter, and
ciuicflow.fsdp's compressed one); then recommends one.

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

Python: ``plan(ClusterSpec(...), Workload(...))`` returns ``Estimate`` objects. The model is held against
what bench/comm and bench/fsdp measured by ``bench/comm/plan_calibration.py`` (the library reads no
bench's files).

Modules: ``methods`` (the strategies and the hooks' parameters), ``units`` (parsing and
formatting), ``inputs`` (``ClusterSpec``, ``Workload``), ``cost_model`` (``estimate``, ``plan``,
``recommend``), ``wire_cost`` (the bytes and time of one compressed exchange), ``fsdp_model``, ``cli``. This package re-exports them.
"""
from ciuicflow.plan.cli import add_arguments, run, table
from ciuicflow.plan.cost_model import Estimate, estimate, plan, recommend
from ciuicflow.plan.inputs import ClusterSpec, Workload, compute_seconds_from_flops, powersgd_elements
from ciuicflow.plan.methods import (EXACT_STRATEGIES, FSDP_STRATEGIES, HSDP_STRATEGIES,
                                    ONE_DIM_STRATEGIES, POWERSGD_RANK, RANKED, STRATEGIES)
from ciuicflow.plan.units import parse_bandwidth, parse_count, parse_seconds

__all__ = [
    "STRATEGIES", "EXACT_STRATEGIES", "FSDP_STRATEGIES", "HSDP_STRATEGIES", "ONE_DIM_STRATEGIES", "RANKED", "POWERSGD_RANK",
    "parse_count", "parse_bandwidth", "parse_seconds", "ClusterSpec", "Workload",
    "compute_seconds_from_flops", "powersgd_elements", "Estimate", "estimate", "plan", "recommend",
    "add_arguments", "table", "run",
]
