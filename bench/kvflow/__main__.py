"""KV-flow benchmark: what flow control buys when KV caches share a link, and what the sidecar costs.

1. Shaped link. Two sidecars, prefill0 and decode0, on two simulated nodes (network namespaces) joined by a
   link shaped with tc tbf (ciuicflow/testing/cluster.py). Beside each runs a client process: the sender replays an
   open-loop arrival schedule of KV-cache transfers sized from DeepSeek-V3's real footprint (61 layers x
   (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes = 70,272 bytes per token; each request is sent as 61
   parts, one per layer, as a paged MLA cache holds them), the receiver collects every transfer layer by layer and checks
   its bytes. Short high-priority requests and long low-priority ones arrive at ~80% of the link rate. The
   same schedule runs with ``x-ciuic-flow: enabled`` (mode "flow") and without it (mode "fifo"), then each
   mode once more with a backlog (every request at t=0, phase "saturated") to measure goodput at full load.
   Per class: p50/p99/max transfer latency (arrival -> last layer at the decode client) and time to first
   layer, goodput (payload bytes delivered per second) and link utilisation (bytes on the veth, per second,
   over the rate).
2. Raw throughput on loopback (no shaping): the same bytes through the two sidecars (flow and fifo) and
   through a plain gRPC stream (a minimal streaming service written here: one stream per request, one
   message per layer part, straight from sender to receiver - what a naive connector does). All requests
   are issued at once. ciuicflow: from the phase's start (the sender issues every send) until the receiving
   process holds, and has compared with what was sent, the last part of every request; its clients hand the
   bytes to their own sidecar in shared memory when they can (same host), and the sidecar-to-sidecar hop is
   gRPC over TCP on 127.0.0.1. Plain gRPC: from the first request issued until the receiving server has
   answered for every stream (it answers once it holds all of a stream's bytes and has compared each
   message with what was sent, as ciuicflow's receiver does).
   Throughput = payload bytes / that time; best of --raw-reps. --raw-only runs just this part.

Writes a list of records as JSON (--json), a markdown table and a PNG latency chart next to it. The pieces:
kvflow_workload.py (requests and phases), kvflow_workers.py (the sender, receiver and plain gRPC processes),
kvflow_testbed.py (starting and running them), kvflow_report.py (statistics, targets, outputs).

    python -m bench.kvflow                                  # 100 Mbit/s link, 40 s of arrivals per mode
    python -m bench.kvflow --smoke --json out/kvflow.json   # CI: well under a minute
    python -m bench.kvflow --rate 400mbit --duration 60 --load 0.8 --check-targets

Needs root for namespaces and tc; without them the link is emulated on loopback by the receiving sidecar's
--link-rate, and every output says so (NOT tc-shaped).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from ciuicflow.kvflow.sidecar.process import new_token_file
from ciuicflow.testing.kvflow_faults import Faults
from bench.kvflow.report import evaluate, fmt_seconds, phase_records, raw_records, write_outputs
from bench.kvflow.testbed import PlainServer, Testbed, free_port, host_launch
from bench.kvflow.workers import worker_main
from bench.kvflow.workload import (BUFFER_BYTES, BYTES_PER_TOKEN, ELEM, LATENT, ROPE, parse_range, raw_phases,
                             request_bytes, shaped_phases)

PEER_PORT = 50152

SMOKE = dict(rate="100mbit", duration=6.0, high_tokens="8:32", low_tokens="128:384", saturation_s=2.5,
             raw_requests=4, raw_tokens=128, raw_reps=3, timeout=120.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.kvflow", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rate", default="100mbit", help="link rate between the two nodes (tc tbf), e.g. 100mbit")
    p.add_argument("--load", type=float, default=0.8, help="offered load as a fraction of the link rate (0.8)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of open-loop arrivals per mode (40)")
    p.add_argument("--high-share", type=float, default=0.25, help="fraction of offered bytes that is high priority")
    p.add_argument("--high-tokens", default="8:64", help="prompt tokens of a high-priority request, LO:HI")
    p.add_argument("--low-tokens", default="128:512", help="prompt tokens of a low-priority request, LO:HI")
    p.add_argument("--saturation-s", type=float, default=6.0,
                   help="backlogged phase: this many seconds of link time queued at t=0 (0: skip)")
    p.add_argument("--raw-requests", type=int, default=8, help="loopback throughput: requests sent at once")
    p.add_argument("--raw-tokens", type=int, default=256, help="loopback throughput: tokens per request")
    p.add_argument("--raw-reps", type=int, default=3, help="loopback throughput: repetitions (best counts)")
    p.add_argument("--chunk-size", default="256KiB", help="sidecar chunk size")
    p.add_argument("--sidecar-args", default="", help="extra flags for both sidecars, e.g. \"--min-cwnd 1MiB\"")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="short configuration for CI (well under a minute)")
    p.add_argument("--json", metavar="PATH", help="records as JSON (default OUT_DIR/kvflow.json)")
    p.add_argument("--out-dir", help="markdown and PNG go here (default: the --json folder, else out/kvflow)")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--loopback", action="store_true",
                   help="no namespaces: emulate the link with the receiving sidecar's --link-rate (NOT tc-shaped)")
    p.add_argument("--require-netns", action="store_true", help="fail instead of falling back to loopback")
    p.add_argument("--skip-raw", action="store_true", help="skip the loopback throughput comparison")
    p.add_argument("--raw-only", action="store_true",
                   help="only the loopback throughput comparison (no shaped link, no namespaces)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for any one phase")
    p.add_argument("--check-targets", action="store_true", help="exit 1 if a target is missed")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)         # smoke sizes, unless given explicitly
    args = p.parse_args(argv)
    if args.raw_only and args.skip_raw:
        p.error("--raw-only and --skip-raw exclude each other")
    from ciuicflow.testing.cluster import parse_rate
    try:
        args.rate_bps = parse_rate(args.rate)
        args.high_range = parse_range(args.high_tokens, "--high-tokens")
        args.low_range = parse_range(args.low_tokens, "--low-tokens")
    except ValueError as exc:
        p.error(str(exc))
    if not 0 < args.load <= 1.5 or not 0 <= args.high_share <= 1 or args.duration <= 0:
        p.error("need 0 < --load <= 1.5, 0 <= --high-share <= 1, --duration > 0")
    if max(args.high_range[1], args.low_range[1], args.raw_tokens) * (LATENT + ROPE) * ELEM > BUFFER_BYTES:
        p.error("requests too long for the payload buffer")
    out_dir = args.out_dir or (os.path.dirname(os.path.abspath(args.json)) if args.json else "out/kvflow")
    args.out_dir = out_dir
    args.json = args.json or os.path.join(out_dir, "kvflow.json")
    return args


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--worker" in argv:
        return worker_main(argv)
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.monotonic()

    def log(msg):
        print(f"[kvflow-bench {time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    from ciuicflow.testing.cluster import SimCluster, format_rate
    workdir = tempfile.mkdtemp(prefix="ciuicflow-kvbench-")
    rate_Bps = args.rate_bps / 8
    records = []
    cluster = None if args.raw_only else SimCluster(
        nodes=2, ranks_per_node=1, rate=f"{int(args.rate_bps)}bit", require_netns=args.require_netns,
        loopback=args.loopback, log=log)
    testbeds = []
    plain_server = None
    shaped = None
    try:
        chunk = ["--chunk-size", str(args.chunk_size)] + shlex.split(args.sidecar_args)
        if cluster is not None:
            cluster.start()
        if cluster is None:
            testbed_line = "raw loopback throughput only (--raw-only): no shaped link"
        elif cluster.netns:
            # the nodes' addresses are not loopback: the sidecars need a peer credential there
            netns_args = chunk + ["--token-file", new_token_file(workdir)]
            shaped = Testbed("shaped", workdir,
                             (lambda argv, **kw: cluster.popen(0, argv, **kw),
                              lambda argv, **kw: cluster.popen(1, argv, **kw)),
                             (f"{cluster.node_addr(0)}:{PEER_PORT}", f"{cluster.node_addr(1)}:{PEER_PORT}"),
                             (netns_args, netns_args), link_bytes=cluster.link_bytes)
            testbed_line = (f"2 network-namespace nodes, link shaped to {format_rate(args.rate_bps)} with tc tbf "
                            f"(ciuicflow/testing/cluster.py); bytes on the wire from node 0's veth counters")
        else:
            shaped = Testbed("shaped", workdir, (host_launch, host_launch),
                             (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"),
                             (chunk, chunk + Faults(link_rate=int(rate_Bps)).flags()))
            testbed_line = (f"!!! NOT tc-shaped ({cluster.fallback_reason or 'loopback requested'}): loopback, link "
                            f"emulated by decode0's --link-rate {format_rate(args.rate_bps)}; bytes on the wire not "
                            "measured !!!")
        if shaped is not None:
            testbeds.append(shaped)
        raw = None
        if not args.skip_raw:
            raw = Testbed("raw", workdir, (host_launch, host_launch),
                          (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"), (chunk, chunk))
            testbeds.append(raw)
        log(testbed_line)
        for tb in testbeds:
            tb.start_sidecars()
        if raw is not None:
            plain_server = PlainServer(workdir, args.seed)
        phases = shaped_phases(args, rate_Bps) if shaped is not None else []
        plan = {"seed": args.seed, "dest": "decode0", "timeout": args.timeout, "phases": phases}
        if shaped is not None:
            shaped.start_workers(plan, 120)
        if raw is not None:
            raw_plan = {"seed": args.seed, "dest": "decode0", "timeout": args.timeout, "phases": raw_phases(args),
                        "warmup_transfers": args.raw_requests}
            raw.start_workers(raw_plan, 120)
        base = {"shaped": bool(cluster is not None and cluster.shaped), "testbed": testbed_line, "link_rate_bytes_per_s": rate_Bps,
                "load": args.load, "bytes_per_token": BYTES_PER_TOKEN}
        for phase in phases:
            offered = sum(request_bytes(r["tokens"]) for r in phase["requests"])
            log(f"{phase['name']}: {len(phase['requests'])} transfers, {offered / 1e6:.0f} MB")
            result = shaped.run_phase(phase, args.timeout)
            recs = phase_records(phase, result, dict(base, phase=phase["phase"], mode=phase["mode"],
                                                      offered_bytes_per_s=(offered / args.duration
                                                                           if phase["phase"] == "open_loop" else None)))
            records += recs
            for r in recs:
                log(f"  {r['mode']:4} {r['priority']:4} p50 {fmt_seconds(r['p50_s'])} p99 {fmt_seconds(r['p99_s'])} "
                    f"ttfl p99 {fmt_seconds(r['ttfl_p99_s'])} goodput {r['goodput_bytes_per_s'] / 1e6:.1f} MB/s lost {r['lost']}")
        if raw is not None:
            raw_base = {"shaped": False, "testbed": "loopback 127.0.0.1, unshaped", "link_rate_bytes_per_s": None,
                        "bytes_per_token": BYTES_PER_TOKEN}
            raw_recs, plain = [], []
            requests = raw_plan["phases"][0]["requests"]
            for phase in raw_plan["phases"]:       # flow, fifo, plain gRPC, then again: they share the noise
                result = raw.run_phase(phase, args.timeout)
                raw_recs += phase_records(phase, result, dict(raw_base, phase="raw_loopback", mode=phase["mode"],
                                                              rep=phase["rep"]))
                if phase["mode"] == "fifo":
                    plain.append(plain_server.run_once(args, requests, phase["rep"]))
            records += raw_records(raw_recs, plain, requests, raw_base, log)
    finally:
        for tb in testbeds:
            tb.stop_workers()
        sidecars = [sc for tb in testbeds for sc in tb.sidecars]
        for sc in sidecars:         # all at once: each drains for a moment
            sc.terminate()
        for sc in sidecars:
            sc.stop()
        if plain_server is not None:
            plain_server.stop()
        if cluster is not None:
            cluster.close()
        log("sidecars stopped, namespaces removed")
    summary = evaluate(records)
    write_outputs(args, records, summary, testbed_line)
    lost = sum(r["lost"] for r in records if not r.get("aggregate"))
    log(f"done in {time.monotonic() - started:.0f}s; outputs in {args.out_dir}; logs in {workdir}")
    if lost:
        print(f"FAILED: {lost} transfer(s) lost or corrupted", file=sys.stderr)
        return 1
    if args.check_targets and not all(t["met"] for t in summary if t["met"] is not None):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
