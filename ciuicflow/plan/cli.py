"""``ciuicflow plan``'s arguments, table and command."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from ciuicflow.compression.policy import ADAPTIVE_OPTIMIZER_POLICIES, explain, outer_wire
from ciuicflow.plan.cost_model import plan, recommend
from ciuicflow.plan.diloco_model import diloco
from ciuicflow.plan.inputs import BACKENDS, OPTIMIZERS, SERVER_CODECS, ClusterSpec, Workload, \
    compute_seconds_from_flops
from ciuicflow.plan.methods import ALL_STRATEGIES, EXACT_STRATEGIES, FSDP_STRATEGIES, POWERSGD_RANK, STRATEGIES, \
    cost, default_rank
from ciuicflow.plan.units import format_bytes, format_seconds, parse_bandwidth, parse_count, parse_seconds

# what the opt-in codecs cost in training under Adam, as measured (docs/history/convergence-notebook.md)
_ADAPTIVE_COSTS = {
    "same": "1-bit gradients under Adam ended 2.7-8.1% above exact loss on bench/convergence's language "
            "models: for 1 bit with Adam use ciuicflow.OneBitAdam",
}


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
    parser.add_argument("--ranks", default=None,
                        help="PowerSGD ranks to consider, e.g. 4,16 (default: PowerSGD's default rank, "
                             f"{POWERSGD_RANK}, and {default_rank('adam')} with --optimizer adam; lower ranks "
                             "lost accuracy in bench/convergence). Each is costed as the rank "
                             "sent: PowerSGDState(rank=R) sends its adaptive optimizer's buckets at "
                             "adaptive_rank, 2R unless set")
    parser.add_argument("--hidden", type=int, help="hidden size, for PowerSGD (default: estimated from size)")
    parser.add_argument("--local-ns-per-element", type=float, default=0.02,
                        help="compressors' element-wise work, ns per gradient element (default 0.02: GPU)")
    parser.add_argument("--matmul-tflops", type=float, default=50.0, help="float32 TFLOP/s for PowerSGD's matmuls")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDP bucket size in MiB: one all-reduce (and its latency) per bucket (default 25)")
    parser.add_argument("--overlap", type=float, default=0.0,
                        help="share of the backward pass communication can hide (0..1, default 0)")
    parser.add_argument("--fsdp", action="store_true",
                        help="model FSDP2 instead of DDP: sharded inside each node (HSDP, and ciuicflow.fsdp's "
                             "hierarchical methods) and over every rank (FSDP2's reduce-scatter, and "
                             "ciuicflow.fsdp's compressed one)")
    parser.add_argument("--backend", choices=BACKENDS, default="nccl",
                        help="the collectives' library (default nccl); gloo's reduce-scatter is a whole "
                             "all-reduce, which matters for FSDP over every rank")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="what steps the parameters (default sgd): with adam (or AdamW, any adaptive "
                             "optimizer) the 1-bit and int4 methods send int4, raised to int8 per bucket "
                             "where measured noise says so; they are costed at int4")
    parser.add_argument("--adaptive-optimizer", choices=ADAPTIVE_OPTIMIZER_POLICIES, default="",
                        help="with --optimizer adam: the 1-bit states' adaptive_optimizer, what they send "
                             "those buckets as (default auto, theirs: int4, then int8 where measured noise "
                             "says so; int4, int8: that codec on every bucket; same: 1 bit)")
    parser.add_argument("--values-share", type=float, default=1.0,
                        help="share of the 1-bit all-reduces' chunks that also send values (concentrated "
                             "windows, 0 to 1; default 1, the upper bound: which windows are depends on "
                             "the gradients; 0: plain signs and scales)")
    parser.add_argument("--server-codec", choices=SERVER_CODECS[1:], default="",
                        help="the 1-bit states' server_codec where their exchange has two phases (beyond "
                             "four nodes, or with --phases 2): what the servers send (default auto, theirs: "
                             "int4; onebit_int4: 1 bit with int4 in a tenth of the chunks; same: 1 bit)")
    parser.add_argument("--phases", choices=("auto", "1", "2"), default="auto",
                        help="the quantising states' phases (default auto, theirs: 1 bit in one phase up to "
                             "four nodes; 2: each node serves a segment, 1 bit's servers then send "
                             "--server-codec's codec, or 1 bit where that is auto)")
    parser.add_argument("--strategies", help=f"comma-separated subset of {','.join(ALL_STRATEGIES)}")
    parser.add_argument("--explain", action="store_true",
                        help="also print what each quantising DDP method sends and why "
                             "(ciuicflow.explain: the rule the compressors take)")
    parser.add_argument("--diloco", metavar="H[,H...]",
                        help="also model ciuicflow.diloco syncing every H inner steps, or auto: "
                             "its default for --diloco-codec (docs/diloco.md)")
    parser.add_argument("--diloco-codec", default="auto",
                        help="its outer exchange's codec (default auto, ciuicflow.diloco's: 1 bit "
                             "under --optimizer sgd, int4 under adam)")
    parser.add_argument("--fragments", type=int, default=1, help="its fragments (default 1)")
    parser.add_argument("--fragment-sync-delay", type=int, default=0,
                        help="inner steps a fragment's sync overlaps (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the estimates as JSON")


def _build(args):
    params = parse_count(args.model if args.model is not None else args.params)
    cluster = ClusterSpec(args.nodes, args.gpus_per_node, parse_bandwidth(args.intra_bw),
                          parse_bandwidth(args.inter_bw), parse_seconds(args.intra_latency),
                          parse_seconds(args.inter_latency), backend=args.backend)
    if args.compute_seconds is not None:
        compute, source = args.compute_seconds, "given"
    else:
        compute = compute_seconds_from_flops(params, args.tokens_per_gpu, args.gpu_tflops * 1e12, args.mfu)
        source = (f"6 x params x {args.tokens_per_gpu:g} tokens / ({args.gpu_tflops:g} TFLOP/s x "
                  f"MFU {args.mfu:g})")
    workload = Workload(params, compute, args.accum, args.grad_bytes, args.hidden,
                        local_seconds_per_element=args.local_ns_per_element * 1e-9,
                        matmul_flops=args.matmul_tflops * 1e12, overlap=args.overlap,
                        bucket_bytes=args.bucket_mb * 2 ** 20, optimizer=args.optimizer,
                        adaptive_optimizer=args.adaptive_optimizer, values_share=args.values_share,
                        server_codec=args.server_codec,
                        phases=args.phases if args.phases == "auto" else int(args.phases))
    if args.adaptive_optimizer and args.optimizer != "adam":
        raise ValueError("--adaptive-optimizer applies under an adaptive optimizer: pass --optimizer adam")
    ranks = _ranks(args.ranks) if args.ranks else None
    strategies = list(FSDP_STRATEGIES) if args.fsdp else None
    if args.strategies:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        unknown = [s for s in strategies if s not in ALL_STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; choose from {ALL_STRATEGIES}")
    return cluster, workload, ranks, strategies, source


def _ranks(text: str) -> tuple:
    try:
        ranks = tuple(int(r) for r in str(text).split(",") if r.strip())
    except ValueError:
        ranks = ()
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--ranks must be comma-separated positive integers, got {text!r}")
    return ranks


def table(estimates, baseline) -> str:
    rows = ["| strategy | comm / step | step time | comm share | inter-node per node | intra-node per GPU | "
            f"vs {baseline.strategy if baseline else 'flat_ring'} |", "|---|---:|---:|---:|---:|---:|---:|"]
    for e in estimates:
        share = e.comm_seconds / e.step_seconds if e.step_seconds else 0.0
        speed = f"{baseline.step_seconds / e.step_seconds:.2f}x" if baseline and e.step_seconds else "n/a"
        rows.append(f"| {e.name} | {format_seconds(e.comm_seconds)} | {format_seconds(e.step_seconds)} | {share:.0%} | "
                    f"{format_bytes(e.inter_node_bytes_per_node)} | {format_bytes(e.intra_node_bytes_per_gpu)} | "
                    f"{speed} |")
    return "\n".join(rows)


def _period(text: str):
    """A ``--diloco`` entry: an inner step count, or "auto"."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--diloco takes inner step counts or auto, got {text!r}") from None


def diloco_table(estimates, baseline) -> str:
    """One row per ``--diloco`` H: inter-node bytes per node and exposed seconds per inner step."""
    rows = ["| ciuicflow.diloco | outer exchange | inter-node per node / step | local work / sync | "
            f"exposed sync / step | step time | vs {baseline.strategy if baseline else 'flat_ring'} |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for e in estimates:
        speed = f"{baseline.step_seconds / e.step_seconds:.2f}x" if baseline and e.step_seconds else "n/a"
        rows.append(f"| {e.name} | {e.wire} | {format_bytes(e.inter_bytes_per_step)} | "
                    f"{format_seconds(e.local_seconds)} | {format_seconds(e.exposed_seconds_per_step)} | {format_seconds(e.step_seconds)} | "
                    f"{speed} |")
    return "\n".join(rows)


def run(args) -> int:
    try:
        cluster, workload, ranks, strategies, source = _build(args)
        estimates = plan(cluster, workload, strategies, ranks)
    except ValueError as exc:
        print(f"ciuicflow plan: error: {exc}", file=sys.stderr)
        return 2
    best, why = recommend(estimates)
    baseline = next((e for e in estimates if e.strategy == "flat_ring"), None) or \
        next((e for e in estimates if e.strategy == "fsdp_hsdp"), None)
    print(f"Model {workload.params / 1e9:.3g}B parameters ({workload.grad_bytes}-byte gradients, "
          f"{format_bytes(workload.params * workload.grad_bytes)} per all-reduce), hidden ~{workload.hidden_size}; "
          f"{cluster.nodes} nodes x {cluster.gpus_per_node} GPUs; intra {format_bytes(cluster.intra_bw)}/s "
          f"{format_seconds(cluster.intra_latency)}, inter {format_bytes(cluster.inter_bw)}/s per node "
          f"{format_seconds(cluster.inter_latency)}")
    print(f"Compute {format_seconds(workload.compute_seconds)} per micro-batch ({source}), accum {workload.accum}, "
          f"overlap {workload.overlap:g}")
    if workload.optimizer == "adam":
        sent = workload.adaptive_optimizer or ("their default, auto: int4, a bucket raised to int8 where its "
                                               "measured noise says so (costed at int4)")
        print(f"Adaptive optimizer: the 1-bit methods send its buckets as {sent} (--adaptive-optimizer)")
    if workload.phases != "auto" or workload.server_codec not in ("", "auto"):
        print(f"Quantising states modelled with phases={workload.phases!r}, server_codec="
              f"{workload.server_codec or 'auto'!r} (their defaults: 'auto'); the accuracy each costs: "
              f"docs/convergence.md")
    print()
    print(table(estimates, baseline))
    print()
    print(f"Recommended: {best.name} - {why}")
    if workload.optimizer == "adam" and best.strategy not in EXACT_STRATEGIES \
            and cost(best.strategy).adaptive_family and workload.adaptive_optimizer in _ADAPTIVE_COSTS:
        print(f"({best.strategy} with adaptive_optimizer={workload.adaptive_optimizer}: "
              f"{_ADAPTIVE_COSTS[workload.adaptive_optimizer]}; docs/history/convergence-notebook.md)")
    if workload.optimizer == "sgd" and best.strategy not in EXACT_STRATEGIES \
            and cost(best.strategy).adaptive_family and cost(best.strategy).payload_bits == 1:
        under_adam = explain(best.strategy.removeprefix("fsdp_"), nodes=cluster.nodes,
                             ranks_per_node=cluster.gpus_per_node, optimizer="adam").codec
        print(f"(modelled with SGD; under Adam/AdamW {best.strategy} sends {under_adam} values, raised "
              f"to int8 where measured noise says so: pass --optimizer adam)")
    try:
        localsgd = []
        for h in args.diloco.split(",") if args.diloco else []:
            codec, period, _ = outer_wire(args.diloco_codec, _period(h), workload.optimizer == "sgd")
            localsgd.append(diloco(cluster, workload, period, args.fragments,
                                   args.fragment_sync_delay, codec))
    except ValueError as exc:
        print(f"ciuicflow plan: error: {exc}", file=sys.stderr)
        return 2
    if localsgd:
        print("\n" + diloco_table(localsgd, baseline))
    plans = wire_plans(estimates, cluster, workload) if args.explain else []
    if plans:
        print("\nWhat each quantising method sends (ciuicflow.explain):")
        for wire in plans:
            print(wire.describe())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": asdict(cluster), "workload": asdict(workload),
                       "compute_source": source, "estimates": [e.as_dict() for e in estimates],
                       "recommended": best.name, "reason": why,
                       "wire_plans": [wire.as_dict() for wire in plans],
                       "diloco": [e.as_dict() for e in localsgd]}, f, indent=1)
    return 0


def wire_plans(estimates, cluster: ClusterSpec, workload: Workload) -> list:
    """``ciuicflow.explain`` of each quantising DDP strategy among ``estimates``, for the
    workload's optimizer and options on the cluster's GPUs."""
    options = {"phases": workload.phases, "server_codec": workload.server_codec or "auto"}
    if workload.adaptive_optimizer:
        options["adaptive_optimizer"] = workload.adaptive_optimizer
    return [explain(e.strategy, nodes=cluster.nodes, ranks_per_node=cluster.gpus_per_node,
                    device="cuda", optimizer=workload.optimizer, **options)
            for e in estimates if e.strategy in STRATEGIES and e.strategy not in EXACT_STRATEGIES
            and cost(e.strategy).kind == "quantized"]
