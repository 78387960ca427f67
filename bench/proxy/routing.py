"""The vLLM proxy's decode routing under an uneven load: ``--routing load`` against ``--routing round-robin``,
both with ``--discovery``, at the same open-loop request stream (the target: high-priority TTFT p99
at least 30% lower with load-aware routing).

On 127.0.0.1: a real etcd (ciuicflow/testing/etcd.py), M prefill and N decode nodes, each a real sidecar
registered in etcd with discovery (role, --server-url, pairwise secrets) beside a fake OpenAI-compatible
server (bench/proxy/fakes.py: prefill hands its KV to its sidecar layer by layer and answers with
the connector's kv_transfer_params; decode waits for the whole transfer at its own sidecar, then streams
tokens), and the real proxy twice: one process per policy, both reading the same registry. Every decode
sidecar reads its peers at ``--link-rate``. The load is uneven by ``--scenario``:

- ``backlog`` (default): a further sidecar (no server, so never routed to) keeps ``--backlog-streams``
  low-priority transfers of ``--backlog-size`` in flight to decode0 (a KV migration, another fleet's
  traffic): decode0's link is busy, its sidecar reports the transfers, the proxy's own count does not
  see them;
- ``slow-link``: decode0's link is ``--slow-factor`` times slower than the others'.

Requests: Poisson arrivals at ``--rate``, ``--high-frac`` short high-priority prompts and the rest long
low-priority ones, streamed through the proxy with ``x-ciuic-priority``; TTFT is client send -> first token
from the decode server. The policies alternate in ABBA order (``--rounds`` pairs of segments of
``--segment-s`` of arrivals), each pair on the same arrivals and prompts, each segment drained before the
next: drift on this shared host falls on both. Output: JSON and a Markdown table (TTFT p50/p90/p99 per
policy and class, the share of requests each decode node got) and the ratio load / round-robin.

    python -m bench.proxy.routing --out out/proxy_routing                        # backlog, ~4.5 min
    python -m bench.proxy.routing --scenario slow-link --out out/proxy_routing_slow   # ~6 min
    python -m bench.proxy.routing --smoke --json out/proxy_routing.json           # CI, < 45 s

Needs etcd (apt-get install -y etcd-server). No vLLM, no GPU.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Dict, List

from bench.soak.chaos import _secrets
from bench.proxy.fakes import add_timing_flags
from bench.vllm.report import pct

from ciuicflow.kvflow.sidecar.process import REPO_ROOT, SidecarProcess, child_env, free_port, log_tail
from ciuicflow.testing.etcd import Etcd
from ciuicflow.testing.kvflow_faults import sidecar_module  # noqa: E402  (--link-rate: the fault launcher)

PREFIX = "/routing"
POLICIES = ("load", "round-robin")
FAKES = ["-m", "bench.proxy.fakes"]
TARGET = 0.7            # high-priority TTFT p99, load / round-robin, at most this (30% lower)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", choices=("backlog", "slow-link"), default="backlog")
    p.add_argument("--prefill", type=int, default=2, help="prefill nodes")
    p.add_argument("--decode", type=int, default=3, help="decode nodes")
    p.add_argument("--link-rate", default="100Mbit", help="each decode sidecar's incoming link (emulated)")
    p.add_argument("--slow-factor", type=float, default=4.0, help="slow-link: decode0's link this many times slower")
    p.add_argument("--backlog-size", default="8MiB", help="backlog: bytes per low-priority transfer to decode0")
    p.add_argument("--backlog-streams", type=int, default=2, help="backlog: such transfers in flight")
    p.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    p.add_argument("--segment-s", type=float, default=40.0, help="seconds of arrivals per segment")
    p.add_argument("--rounds", type=int, default=3, help="ABBA: each round is two segments, one per policy")
    p.add_argument("--high-frac", type=float, default=0.5)
    p.add_argument("--short-len", type=int, default=128, help="high-priority prompt tokens (+-25%%)")
    p.add_argument("--long-len", type=int, default=1024, help="low-priority prompt tokens (+-25%%)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--load-s", type=float, default=1.0, help="the sidecars' --discovery-load-s")
    p.add_argument("--ttl", type=int, default=5, help="the sidecars' --discovery-ttl-s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CI: 2 decode, 1 prefill, one round of 5 s segments")
    p.add_argument("--out", default="", help="directory for proxy_routing.json and .md")
    p.add_argument("--json", help="also write the JSON here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    add_timing_flags(p)
    a = p.parse_args(argv)
    if a.smoke:
        a.prefill, a.decode, a.rounds, a.segment_s = 1, 2, 1, 5.0
    if a.decode < 2:
        p.error("--decode: at least 2 (routing chooses among them)")
    return a


def rate_bytes(text: str) -> float:
    """'100Mbit' / '12.5MB' / a number (bytes/s), as the sidecar's --link-rate reads it."""
    t = str(text).strip()
    low = t.lower()
    for suffix, mult in (("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8), ("gb", 1e9), ("mb", 1e6),
                         ("kb", 1e3), ("b", 1)):
        if low.endswith(suffix):
            return float(t[:-len(suffix)]) * mult
    return float(t)


class Fleet:
    """etcd, the sidecars, the fake servers and the two proxies, on loopback ports."""

    def __init__(self, a):
        self.a = a
        self.workdir = tempfile.mkdtemp(prefix="proxy-routing-")
        self.procs: List[subprocess.Popen] = []
        self.sidecars: Dict[str, SidecarProcess] = {}
        self.etcd = Etcd(self.workdir)
        try:
            self._start()
        except BaseException:
            self.close()        # nothing left running when the start fails
            raise

    def _start(self) -> None:
        a = self.a
        self.etcd.start()
        self.prefills = [f"prefill{i}" for i in range(a.prefill)]
        self.decodes = [f"decode{i}" for i in range(a.decode)]
        names = self.prefills + self.decodes + (["bulk0"] if a.scenario == "backlog" else [])
        secrets = _secrets(self.workdir, names)
        self.server_port = {n: free_port() for n in self.prefills + self.decodes}
        link = rate_bytes(a.link_rate)
        for name in names:
            role = "decode" if name.startswith("decode") else "prefill"
            args = ["--discovery", self.etcd.url(PREFIX), "--role", role, "--discovery-ttl-s", str(a.ttl),
                    "--discovery-load-s", str(a.load_s), "--peer-secrets-file", secrets[name]]
            if name in self.server_port:
                args += ["--server-url", f"http://127.0.0.1:{self.server_port[name]}"]
            if role == "decode":
                rate = link / a.slow_factor if (a.scenario == "slow-link" and name == "decode0") else link
                args += ["--link-rate", str(int(rate))]
            self.sidecars[name] = SidecarProcess(name, f"127.0.0.1:{free_port()}", {},
                                                 os.path.join(self.workdir, f"sidecar-{name}.log"), args,
                                                 module=sidecar_module(args)).start()
        for sc in self.sidecars.values():
            sc.wait_ready(120)
        timing = ["--kv-bytes-per-token", str(a.kv_bytes_per_token), "--layers", str(a.layers),
                  "--prefill-us-per-token", str(a.prefill_us_per_token), "--decode-step-ms", str(a.decode_step_ms),
                  "--tpot-ms", str(a.tpot_ms)]
        fakes = []
        for name in self.prefills + self.decodes:
            role = "prefill" if name.startswith("prefill") else "decode"
            fakes.append(self._spawn(f"fake-{name}", [
                sys.executable, *FAKES, role, "--port", str(self.server_port[name]),
                "--sidecar", self.sidecars[name].api, "--name", name,
                "--log", os.path.join(self.workdir, f"requests-{name}.jsonl"), *timing]))
        self.proxy_port = {}
        for policy in POLICIES:
            self.proxy_port[policy] = free_port()
            fakes.append(self._spawn(f"proxy-{policy}", [sys.executable, "-m", "ciuicflow.integrations.vllm.proxy",
                                                         "--port", str(self.proxy_port[policy]),
                                                         "--discovery", self.etcd.url(PREFIX), "--routing", policy]))
        for log, ready in fakes:
            self._wait_log(log, ready, 120)
        self._wait_adopted(60)
        self.backlog_log = os.path.join(self.workdir, "backlog.jsonl")
        if a.scenario == "backlog":
            log, ready = self._spawn("backlog", [
                sys.executable, *FAKES, "backlog", "--sidecar", self.sidecars["bulk0"].api, "--name", "bulk0",
                "--dest", "decode0", "--dest-sidecar", self.sidecars["decode0"].api, "--size", a.backlog_size,
                "--streams", str(a.backlog_streams), "--log", self.backlog_log])
            self._wait_log(log, "backlog ready", 60)

    def _spawn(self, name: str, argv: List[str]):
        log = os.path.join(self.workdir, f"{name}.log")
        with open(log, "wb") as fh:
            self.procs.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=child_env(), stdout=fh,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True))
        return log, "ready"

    def _wait_log(self, log: str, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in log_tail(log, None):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"{log}: no {text!r}:\n{log_tail(log)}")
            time.sleep(0.1)

    def _wait_adopted(self, timeout: float) -> None:
        """Every prefill sidecar has every decode one as a peer (discovery, names proved), and back."""
        from ciuicflow.kvflow import Client
        deadline = time.monotonic() + timeout
        clients = {n: Client(sc.api) for n, sc in self.sidecars.items()}
        try:
            while True:
                missing = {}
                for n, c in clients.items():
                    want = set(self.decodes) if not n.startswith("decode") else set(self.prefills)
                    lacks = want - set(c.stats()["discovery"]["peers"]) - {n}
                    if lacks:
                        missing[n] = sorted(lacks)
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"peers not adopted after {timeout:g} s: {missing}")
                time.sleep(0.2)
        finally:
            for c in clients.values():
                c.close()

    def url(self, policy: str) -> str:
        return f"http://127.0.0.1:{self.proxy_port[policy]}"

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for sc in self.sidecars.values():
            sc.stop(10)
        self.etcd.stop(signal.SIGKILL)
        if not self.a.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def complete(base: str, prompt_len: int, priority: str, max_tokens: int, timeout: float = 120.0) -> dict:
    """One streamed /v1/completions through the proxy: TTFT (send -> first token), the decode node chosen."""
    host, port = base.split("//", 1)[1].split(":")
    body = json.dumps({"model": "fake", "prompt": [1] * prompt_len, "max_tokens": max_tokens, "stream": True})
    t0 = time.monotonic()
    out = {"ok": False, "decode": None, "ttft_s": None, "error": None}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                       "x-ciuic-priority": priority})
        r = conn.getresponse()
        out["decode"] = r.getheader("x-ciuic-decode")
        out["prefill_failed"] = r.getheader("x-ciuic-prefill") == "failed"
        if r.status != 200:
            out["error"] = f"{r.status}: {r.read()[:200]!r}"
            return out
        tokens = 0
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if line[5:].strip() == b"[DONE]":
                break
            if tokens == 0:
                out["ttft_s"] = time.monotonic() - t0
            tokens += 1
        out["ok"] = tokens == max_tokens
        if not out["ok"]:
            out["error"] = f"{tokens} of {max_tokens} tokens"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        out["error"] = str(exc)[:200]
    finally:
        conn.close()
        out["done_s"] = time.monotonic() - t0
    return out


def workload(a, seed: int) -> List[dict]:
    """Poisson arrivals over one segment; each request high (short prompt) or low (long prompt)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(a.rate)
        if t >= a.segment_s:
            return out
        high = rng.random() < a.high_frac
        base = a.short_len if high else a.long_len
        out.append({"at": t, "cls": "high" if high else "low", "len": max(1, int(base * rng.uniform(0.75, 1.25)))})


def run_segment(base: str, reqs: List[dict], new_tokens: int) -> List[dict]:
    """Open loop: each request sent at its arrival time on a thread of its own; returns once all ended."""
    results: List[dict] = [None] * len(reqs)
    threads = []

    def one(i, r):
        results[i] = {**r, **complete(base, r["len"], r["cls"], new_tokens)}

    t0 = time.monotonic()
    for i, r in enumerate(reqs):
        delay = t0 + r["at"] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i, r), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(180)
    return [r if r is not None else {"ok": False, "error": "no answer in 180 s"} for r in results]


def summarize(results: List[dict], decodes: List[str]) -> dict:
    out = {}
    for policy in POLICIES:
        rs = [r for r in results if r["policy"] == policy]
        ok = [r for r in rs if r.get("ok")]
        share = Counter(r.get("decode") for r in ok)
        s = {"sent": len(rs), "failed": len(rs) - len(ok),
             "prefill_failed": sum(1 for r in rs if r.get("prefill_failed")),
             "decode_share": {d: round(share.get(d, 0) / max(1, len(ok)), 3) for d in decodes}, "classes": {}}
        for cls in ("high", "low"):
            v = [r["ttft_s"] for r in ok if r["cls"] == cls]
            c = {"n": len(v)}
            for q in (0.5, 0.9, 0.99):
                x = pct(v, q)
                c[f"ttft_p{int(q * 100)}_ms"] = None if x is None else round(x * 1e3, 1)
            c["ttft_max_ms"] = round(max(v) * 1e3, 1) if v else None
            by = {d: [r["ttft_s"] for r in ok if r["cls"] == cls and r["decode"] == d] for d in decodes}
            c["by_decode_p50_ms"] = {d: round(pct(v, 0.5) * 1e3, 1) if v else None for d, v in by.items()}
            s["classes"][cls] = c
        out[policy] = s
    return out


def ratio(s: dict, cls: str, key: str):
    a, b = s["load"]["classes"][cls][key], s["round-robin"]["classes"][cls][key]
    return round(a / b, 3) if a is not None and b else None


def table(report: dict) -> str:
    s, decodes = report["summary"], report["config"]["decodes"]
    lines = ["| policy | class | n | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | max ms | "
             + " | ".join(f"share {d}" for d in decodes) + " |",
             "|" + "---|" * (7 + len(decodes))]
    for policy in POLICIES:
        for cls in ("high", "low"):
            c = s[policy]["classes"][cls]
            share = " | ".join(f"{s[policy]['decode_share'][d]:.2f}" for d in decodes)
            lines.append(f"| {policy} | {cls} | {c['n']} | {c['ttft_p50_ms']} | {c['ttft_p90_ms']} | "
                         f"{c['ttft_p99_ms']} | {c['ttft_max_ms']} | {share} |")
    r = report["ratios"]
    lines += ["", f"load / round-robin, high priority: TTFT p99 {r['high_p99']}x (target <= {TARGET}: "
                  f"{'met' if report['target_met'] else 'not met'}), p50 {r['high_p50']}x; "
                  f"low priority: p99 {r['low_p99']}x, p50 {r['low_p50']}x"]
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    t_start = time.monotonic()
    fleet = Fleet(a)
    print(f"[{time.monotonic() - t_start:5.1f}s] fleet up: {fleet.prefills} {fleet.decodes} ({a.scenario}); "
          f"work dir {fleet.workdir}", flush=True)
    results, segments = [], []
    try:
        for policy in POLICIES:         # warm-up: every decode node answers through each proxy
            for _ in range(2 * a.decode if not a.smoke else a.decode):
                complete(fleet.url(policy), a.short_len, "high", a.new_tokens)
        if a.scenario == "backlog":
            time.sleep(max(1.0, 2 * a.load_s))      # the backlog's load is in the registry
        for rnd in range(a.rounds):
            reqs = workload(a, a.seed * 1000 + rnd)
            order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
            for policy in order:
                t0 = time.monotonic()
                rs = run_segment(fleet.url(policy), reqs, a.new_tokens)
                for r in rs:
                    r.update(policy=policy, round=rnd)
                results += rs
                high = [r["ttft_s"] for r in rs if r.get("ok") and r["cls"] == "high"]
                segments.append({"round": rnd, "policy": policy, "requests": len(rs),
                                 "failed": sum(1 for r in rs if not r.get("ok")),
                                 "seconds": round(time.monotonic() - t0, 1),
                                 "high_p99_ms": round(pct(high, 0.99) * 1e3, 1) if high else None})
                print(f"[{time.monotonic() - t_start:5.1f}s] round {rnd} {policy}: {segments[-1]}", flush=True)
        backlog = []
        if os.path.exists(fleet.backlog_log):
            with open(fleet.backlog_log) as fh:
                backlog = [json.loads(x) for x in fh if x.strip()]
    finally:
        fleet.close()
    summary = summarize(results, fleet.decodes)
    ratios = {"high_p99": ratio(summary, "high", "ttft_p99_ms"), "high_p50": ratio(summary, "high", "ttft_p50_ms"),
              "low_p99": ratio(summary, "low", "ttft_p99_ms"), "low_p50": ratio(summary, "low", "ttft_p50_ms")}
    config = {k: v for k, v in vars(a).items() if k not in ("out", "json", "keep")}
    config.update(decodes=fleet.decodes, prefills=fleet.prefills,
                  command=" ".join(["python -m bench.proxy.routing", *(argv if argv is not None else sys.argv[1:])]))
    report = {"config": config, "segments": segments, "summary": summary, "ratios": ratios,
              "target": f"high TTFT p99 load/round-robin <= {TARGET}",
              "target_met": ratios["high_p99"] is not None and ratios["high_p99"] <= TARGET,
              "backlog": {"transfers": len(backlog), "mean_s": round(sum(b["s"] for b in backlog) / len(backlog), 2)
                          if backlog else None},
              "seconds": round(time.monotonic() - t_start, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "loadavg": os.getloadavg(), "requests": results}
    md = table(report)
    print(md, flush=True)
    paths = []
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        paths += [os.path.join(a.out, "proxy_routing.json")]
        with open(os.path.join(a.out, "proxy_routing.md"), "w") as fh:
            fh.write(f"`{config['command']}` ({report['date']}, {report['seconds']} s, load average "
                     f"{report['loadavg'][0]:.1f})\n\n{md}\n")
    if a.json:
        paths.append(a.json)
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
    failed = sum(s["failed"] for s in summary.values())
    ok = failed == 0 and all(summary[p]["classes"][c]["n"] for p in POLICIES for c in ("high", "low"))
    if not ok:
        print(f"FAILED: {failed} requests failed, or a policy/class without answers", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
