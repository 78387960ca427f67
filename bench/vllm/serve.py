"""Serving benchmark of disaggregated vLLM over the sidecars: open-loop OpenAI requests against the proxy,
a mix of short high-priority and long low-priority prompts, flow control on (``x-ciuic-flow: enabled``)
and off (FIFO), on one deployment (the switch is per request). Reports TTFT and TPOT p50/p99 per class,
request throughput and goodput under per-class TTFT SLOs (--slo-factor x each class's unloaded TTFT), and
where each request's TTFT went (bench/vllm/phases.py): JSON, a table (stdout and .md) and a PNG.
With ``--loads`` it sweeps the request rate (fractions of the measured capacity) and reports each mode's
goodput rate: the highest rate at which --slo-attainment (0.9) of the requests meet their SLOs (DistServe).

    python -m bench.vllm.serve --smoke                          # CI: a few requests per mode, seconds of load
    python -m bench.vllm.serve --preset link-bound --out out/vllm_serve_sweep   # the link-bound scenario: a sweep
    python -m bench.vllm.serve --preset link-bound --loads '' --out out/vllm_serve   # one rate (0.8)

The link between the two sides: ``--tc-rate 100mbit`` puts each side in a network namespace joined by a
tbf-shaped link (ciuicflow/testing/cluster.py, bench/vllm/netns.py); otherwise the sidecars' emulated slow
link (``--link-rate``: the receiving sidecar reads peer traffic at that rate; docs/kvflow.md). The request
rate is ``--load`` (0.8) times the capacity measured first with closed-loop requests, unless ``--rate`` is
given; a sweep's rates are each of ``--loads`` times that capacity (or ``--rate``). vLLM runs in its own
environment (``--python``; ``bash scripts/vllm_demo.sh --setup-only`` makes it).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time


from bench.vllm.phases import attach as attach_phases, table as phase_table
from bench.vllm.report import summarize, write_outputs
from ciuicflow.integrations.vllm.demo import Deployment, build_model
from ciuicflow.integrations.vllm.model import VOCAB
from ciuicflow.integrations.vllm.servers import stream_complete
from ciuicflow.testing.kvflow_faults import sidecar_module

MODES = {"flow": "enabled", "fifo": "disabled"}
# link-bound: the scenario flow control exists for. At 5 Mbit/s a long prompt's KV (640 tokens of the tiny
# DeepSeek: 4.4 MB) needs ~7 s of link, a short one's (24 tokens: 0.22 MB) 0.35 s; the mix needs ~3.7 s of
# link per request on average (capacity ~0.27 req/s) against ~2 s of the 2 shared cores' compute, so the
# link saturates first (with each vLLM worker on a core of its own). SLOs: --slo-factor x each class's
# unloaded TTFT. By default a sweep of 0.15, 0.3 and 0.5 of the capacity measured closed-loop, 300 s of
# arrivals per mode and level (27 min measured): FIFO's goodput rate lies near 0.3 of the capacity (its
# high requests wait behind long transfers even at light load), flow control's above 0.5, and the low
# levels need long runs to hold more than a handful of requests (docs/vllm.md). ``--loads ''`` runs the
# single rate instead (0.8, 120 s per mode).
PRESETS = {"link-bound": dict(tc_rate="5mbit", pin_cores=True, duration=120.0, load=0.8, slo_factor=3.0,
                              loads="0.15,0.3,0.5", sweep_duration=300.0)}


def default_python() -> str:
    for py in (os.environ.get("CIUICFLOW_VLLM_PYTHON"), "/work/vllm-venv/bin/python",
               os.path.expanduser("~/.cache/ciuicflow/vllm-venv/bin/python")):
        if py and os.path.exists(py):
            return py
    return sys.executable


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CI size: short prompts, few requests, fixed rate")
    p.add_argument("--model", default="deepseek", choices=("deepseek", "llama"))
    p.add_argument("--python", default=default_python(), help="vLLM's environment's interpreter")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per mode")
    p.add_argument("--requests", type=int, default=0, help="requests per mode instead of --duration")
    p.add_argument("--rate", type=float, default=0.0, help="requests/s (default: --load x measured capacity)")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--loads", default="", help="a sweep instead of one rate: comma-separated fractions of the "
                   "measured capacity (of --rate when given), e.g. 0.3,0.5,0.7,0.9; '' = one rate (--load)")
    p.add_argument("--sweep-duration", type=float, default=0.0, help="seconds of arrivals per mode at each "
                   "level of a sweep (default: --duration)")
    p.add_argument("--slo-attainment", type=float, default=0.9, help="a sweep's goal: the goodput rate is the "
                   "highest rate at which this share of the requests meets its SLOs")
    p.add_argument("--high-frac", type=float, default=0.5, help="share of short high-priority requests")
    p.add_argument("--short-len", type=int, default=24)
    p.add_argument("--long-len", type=int, default=640)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--link-rate", default="100Mbit", help="emulated link into each sidecar ('' = loopback)")
    p.add_argument("--tc-rate", default="", help="instead: a tc-shaped link (e.g. 100mbit) between two network "
                   "namespaces (ciuicflow/testing/cluster.py; needs root, ip, tc)")
    p.add_argument("--pin-cores", action="store_true", help="with --tc-rate: the prefill vLLM worker on core 0, "
                   "the decode one on core 1 (one OpenMP thread each)")
    p.add_argument("--slo-factor", type=float, default=3.0, help="TTFT SLO of each class: this many times its "
                   "unloaded TTFT p50 (measured first: one request at a time)")
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="instead: the high class's TTFT SLO")
    p.add_argument("--slo-ttft-low-ms", type=float, default=0.0, help="instead: the low class's TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=500.0)
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration (defaults; flags still win)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/vllm_serve", help="directory for JSON, table and PNG")
    p.add_argument("--json", metavar="PATH", help="also write the JSON result here (as the other benchmarks)")
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    if a.preset:
        p.set_defaults(**PRESETS[a.preset])
        a = p.parse_args(argv)
    if a.smoke:     # with --loads, the levels scale this fixed rate (no capacity measurement), 6 requests each
        a.requests = a.requests or 6
        a.rate = a.rate or 1.0
        a.short_len, a.long_len, a.new_tokens = 8, 96, 4
    try:
        loads = parse_loads(a.loads)
    except ValueError:
        p.error(f"--loads: comma-separated positive numbers, not {a.loads!r}")
    if loads and not 0 < a.slo_attainment <= 1:
        p.error("--slo-attainment: a share in (0, 1]")
    return a


def parse_loads(text: str):
    """'0.3,0.5' -> [0.3, 0.5]; '' -> [] (no sweep)."""
    loads = [float(x) for x in text.split(",") if x.strip()]
    if any(x <= 0 for x in loads):
        raise ValueError(text)
    return loads


def workload(args, n: int, rate: float, rng: random.Random, exact_mix: bool = False):
    """(arrival offset s, class, prompt) for n requests: Poisson arrivals, each class drawn by --high-frac
    (``exact_mix``: the classes interleaved in exactly that share)."""
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate) if rate > 0 else 0.0
        if exact_mix:
            cls = "high" if int((i + 1) * args.high_frac) > int(i * args.high_frac) else "low"
        else:
            cls = "high" if rng.random() < args.high_frac else "low"
        length = args.short_len if cls == "high" else args.long_len
        length = max(2, int(length * rng.uniform(0.75, 1.25)))
        out.append((t, cls, [rng.randrange(3, VOCAB) for _ in range(length)]))
    return out


_RUN = iter(range(1 << 30))


def run_open_loop(url: str, reqs, new_tokens: int, flow: str, timeout: float):
    """One result per request sent, in arrival order: a request still unanswered after the joins is a
    failure (dropping it would raise the SLO attainment)."""
    run_id = next(_RUN)
    slots, threads = [None] * len(reqs), []
    t0 = time.monotonic()

    def one(i, offset, cls, prompt):
        r = stream_complete(url, prompt, new_tokens, timeout=timeout,
                            headers={"x-ciuic-priority": cls, "x-ciuic-flow": flow})
        r.update(cls=cls, prompt_len=len(prompt), arrival_s=offset, done_s=time.monotonic() - t0, run=run_id)
        r.pop("tokens", None)
        slots[i] = r

    for i, (offset, cls, prompt) in enumerate(reqs):
        delay = t0 + offset - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i, offset, cls, prompt), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout)
    # a copy: a thread answering late writes into ``slots``, not into what is being summarized
    return [r or {"ok": False, "error": "no answer before the load generator's timeout", "cls": cls,
                  "prompt_len": len(prompt), "arrival_s": offset, "done_s": time.monotonic() - t0, "run": run_id}
            for r, (offset, cls, prompt) in zip(slots, reqs)]


def unloaded(url: str, args, rng, per_class: int = 3) -> dict:
    """Each class's TTFT p50 with nothing else running (one request at a time, flow control on): what
    the SLOs are set from, before any loaded run is seen."""
    out = {}
    for cls in ("high", "low"):
        length = args.short_len if cls == "high" else args.long_len
        ttfts = []
        for _ in range(1 if args.smoke else per_class):
            prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
            r = stream_complete(url, prompt, args.new_tokens, headers={"x-ciuic-priority": cls}, timeout=args.timeout)
            if r.get("ok"):
                ttfts.append(r["ttft_s"])
        out[cls] = sorted(ttfts)[len(ttfts) // 2] if ttfts else float("nan")
    return out


def _fmt(d: dict) -> str:
    return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in d.items())


def capacity(url: str, args, rng) -> float:
    """Closed loop, 4 at a time, flow control on: completed requests per second. The classes in exactly
    the workload's share: 8 requests drawn at random made the capacity, hence the rate, a matter of the
    seed (seed 1 drew mostly short ones: 0.55 req/s measured on a link that carries 0.27)."""
    reqs = workload(args, 8, 0.0, rng, exact_mix=True)
    t0 = time.monotonic()
    sem = threading.Semaphore(4)
    threads = []

    def one(prompt, cls):
        with sem:
            stream_complete(url, prompt, args.new_tokens, headers={"x-ciuic-priority": cls}, timeout=args.timeout)

    for _, cls, prompt in reqs:
        th = threading.Thread(target=one, args=(prompt, cls), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(args.timeout)
    return len(reqs) / (time.monotonic() - t0)


def prepare(url: str, args) -> dict:
    """Once per deployment: warm-up, each class's unloaded TTFT (hence the SLOs), the capacity (unless
    --rate). Every rate measured afterwards is judged against these same SLOs."""
    rng = random.Random(args.seed)
    run_open_loop(url, workload(args, 2, 0.0, rng), args.new_tokens, "enabled", args.timeout)   # one-time costs
    idle = unloaded(url, args, rng)
    slo = {cls: (explicit or args.slo_factor * idle[cls] * 1e3) / 1e3 for cls, explicit in
           (("high", args.slo_ttft_ms), ("low", args.slo_ttft_low_ms))}
    cap = None if args.rate else capacity(url, args, rng)
    print(f"[vllm-serve] unloaded TTFT p50 {_fmt(idle)}; TTFT SLO {_fmt(slo)}; capacity "
          f"{'not measured (--rate)' if cap is None else f'{cap:.3f} req/s'}", flush=True)
    return {"unloaded_ttft_s": idle, "slo_ttft_s": slo, "slo_tpot_s": args.slo_tpot_ms / 1e3, "capacity_rps": cap}


def run_rate(url: str, args, rate: float, duration: float, seed: int, slo_ttft_s: dict) -> dict:
    """The same open-loop requests at ``rate`` (``duration`` s of arrivals, or --requests) with flow
    control on and off: each mode's requests and summary."""
    n = args.requests or max(4, int(rate * duration))
    print(f"[vllm-serve] {n} requests per mode at {rate:.3f} req/s", flush=True)
    reqs = workload(args, n, rate, random.Random(seed))    # the same requests in both modes
    out = {"rate_rps": rate, "requests_per_mode": n, "arrival_rps": n / reqs[-1][0] if reqs[-1][0] > 0 else None,
           "order": [], "modes": {}}
    # ABBA: each mode runs twice (halves of the requests), so neither always runs first or on a warmer host
    half = max(1, n // 2)
    runs = {mode: [] for mode in MODES}
    for i, mode in enumerate(("flow", "fifo", "fifo", "flow")):
        part = reqs[:half] if i in (0, 1) else reqs[half:]
        if not part:
            continue
        base = part[0][0]
        shifted = [(t - base, cls, prompt) for t, cls, prompt in part]
        out["order"].append(mode)
        runs[mode] += run_open_loop(url, shifted, args.new_tokens, MODES[mode], args.timeout)
    for mode, rs in runs.items():
        out["modes"][mode] = {"requests": rs, **summarize(rs, slo_ttft_s, args.slo_tpot_ms / 1e3)}
    return out


def measure(url: str, args) -> dict:
    """prepare(), then one rate (--load x capacity, or --rate) or, with --loads, each level in turn, each
    with its own requests (seed + 1 + level index; the single rate's are seed + 1)."""
    base = prepare(url, args)
    loads = parse_loads(args.loads)
    if not loads:
        rate = args.rate or args.load * base["capacity_rps"]
        return {**base, **run_rate(url, args, rate, args.duration, args.seed + 1, base["slo_ttft_s"])}
    reference = args.rate or base["capacity_rps"]
    levels = []
    for i, load in enumerate(loads):
        level = {"load": load, **run_rate(url, args, load * reference, args.sweep_duration or args.duration,
                                          args.seed + 1 + i, base["slo_ttft_s"])}
        print(f"[vllm-serve] load {load:g}: SLO attainment " + ", ".join(
            f"{mode} {m['slo_met']}/{m['completed'] + m['failed']}" for mode, m in level["modes"].items()), flush=True)
        levels.append(level)
    return {**base, "reference_rps": reference, "slo_attainment": args.slo_attainment, "levels": levels}


def client_main(spec_path: str) -> int:
    """--client: the load generator alone (inside the prefill namespace, see vllm_serve_netns.py)."""
    with open(spec_path) as fh:
        spec = json.load(fh)
    out = measure(spec["url"], argparse.Namespace(**spec))
    with open(spec["out"], "w") as fh:
        json.dump(out, fh)
    return 0


def _bps(rate: str):
    from ciuicflow.testing.cluster import parse_rate
    try:
        return parse_rate(rate) if rate else None
    except ValueError:      # e.g. a sidecar --link-rate in bytes ("100MB"): no link phase
        return None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--client"]:
        return client_main(argv[1])
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ciuicflow-vllm-bench-")
    models = os.path.join(os.path.expanduser("~"), ".cache", "ciuicflow", "vllm-models")
    model = build_model(args.python, args.model, "float32", models)
    link_rate = "" if args.tc_rate else args.link_rate
    sidecar_args = ["--link-rate", link_rate] if link_rate else []
    result = {"config": vars(args), "workdir": work,
              "link": f"tc tbf {args.tc_rate} (network namespaces)" if args.tc_rate else
              (f"emulated {link_rate} (sidecar --link-rate)" if link_rate else "loopback")}
    print(f"[vllm-serve] link: {result['link']}; logs in {work}", flush=True)
    if args.tc_rate:
        from bench.vllm.netns import NetnsDeployment
        from ciuicflow.testing.cluster import SimCluster
        with SimCluster(nodes=2, ranks_per_node=1, rate=args.tc_rate, require_netns=True) as cluster:
            dep = NetnsDeployment(cluster, args.python, model, args.model, work, pin_cores=args.pin_cores)
            try:
                dep.start(args.timeout)
                # a guard against a hung client, not a budget: a sweep runs one measurement per level
                result.update(dep.run_client(vars(args), args.timeout * 4 * max(1, len(parse_loads(args.loads)))))
            finally:
                dep.stop()
    else:
        dep = Deployment(args.python, model, args.model, "float32", work, sidecar_args=sidecar_args,
                         sidecar_module=sidecar_module(sidecar_args))
        try:
            dep.start(args.timeout)
            result.update(measure(dep.proxy_url, args))
        finally:
            dep.stop()
    parts = result.get("levels") or [result]     # a sweep: every level has its own modes
    for part in parts:
        attach_phases(part, work, _bps(args.tc_rate or link_rate))
    write_outputs(result, args.out)
    phases = "\n\n".join((f"phases at load {part['load']:g}:\n" if "load" in part else "") + phase_table(part)
                         for part in parts)
    print(phases)
    with open(os.path.join(args.out, "vllm_serve.md"), "a") as fh:
        fh.write("\n" + phases + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    failed = sum(m["failed"] for part in parts for m in part["modes"].values())
    if failed:
        print(f"[vllm-serve] {failed} requests failed (logs in {work})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
