"""KV-flow soak: real sidecars under faults and attack for a bounded time, with a ledger proving that no
acknowledged transfer was lost, none delivered twice and no byte delivered corrupted.

Four sidecars on 127.0.0.1: prefill p0 and p1 send to decode d0 (with --spool-dir: durable) and d1 (memory
only: its senders keep what it holds until its consumers have it). Beside them run client processes
(bench/soak/workers.py): senders (deterministic payloads, idempotency keys, retrying until OK), consumers
(manual_ack: receive, check, record, acknowledge) and a garbage process (random bytes, malformed frames and
messages, bad tickets, idle connections on every port of every sidecar). Meanwhile sidecars are killed with
SIGKILL at random and restarted (one at a time, same ports and spool), and so are the client processes.
The sidecars share a peer token (--token-file) and run under a descriptor limit of 1024 (a usual default;
their ports' caps and ring handle caps come from it).

Beside them run the attackers (bench/soak/attackers.py, never killed), each in rounds with a pause between:
``metrics`` (idle connections up to and past the metrics port's cap, slowloris heads, garbage requests),
``proxy`` (a real vLLM routing proxy with small limits in front of stand-in upstream servers: stalled
connections past its cap, oversized bodies, malformed headers, client-supplied kv_transfer_params, while a
legitimate client's requests go through it), ``packed`` (crafted packed chunks from an authenticated peer:
1.3 million zero-byte part descriptions, and one part over the bound, on both transports) and ``handles``
(client processes parking ring handles on the descriptor socket until the per-client and total caps refuse
them). Meanwhile the orchestrator samples each sidecar's RSS, descriptors and local Stats latency.

Then the senders stop, the consumers drain, and the ledger (bench/soak/ledger.py) is judged:

* lost: acknowledged to a sender (``wait()`` returned OK) and never delivered intact; a loss the guarantees
  allow (a receiver without spool and its sender both killed before the consumer had it) is counted apart;
* duplicates: a delivery that began after a consumer had acknowledged the transfer;
* corrupted: a delivery whose bytes differ from what was sent;
* crashes: a sidecar that exited without being killed;
* the attackers (bench.soak.ledger.judge): each completed a round; nothing went other than the limits
  promise (a refusal missing, a connection held past its timeout, a crafted chunk accepted, an attack
  request reaching an upstream server, ...; excused only in a round whose target was killed meanwhile);
  legitimate transfers (the proxy: requests) completed during each attacker's floods; every sidecar's peak
  RSS within 1.5x its memory cap plus a fixed overhead (its idle RSS + 48 MiB); local Stats on a flooded
  sidecar never failing while it is up, none over 3 s, its median within 100 ms (p90 and worst are
  reported against 100 ms: on a shared host the slowest calls wait for a CPU, floods or not).

    python -m bench.soak --smoke --json out/kvflow_soak.json    # CI: about a minute
    python -m bench.soak --duration 600                          # longer

Exit status 0 only if nothing was lost, duplicated or corrupted, no sidecar crashed and the attackers'
targets held.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from ciuicflow.kvflow.sidecar.process import SidecarProcess, child_env, free_port, new_token_file
from bench.soak.ledger import (STATS_LIMIT_MS, STATS_STALL_MS, Ledger, acked_keys, attack_report,
                                judge, latency_summary, passed, read_all, stats_during, verdict)

WORKERS = ["-m", "bench.soak.workers"]
ATTACKERS = ["-m", "bench.soak.attackers"]
ATTACKER_ROLES = ("metrics", "proxy", "packed", "handles")
SMOKE = dict(duration=30.0, drain=25.0, senders=1, consumers=1, sidecar_kill_s=(4.0, 7.0),
             client_kill_s=(4.0, 7.0), sizes="1000,65536,300000,1200000", attack_pause_s=1.5,
             metrics_extra=24, proxy_stalled=30, hold_s=2.0)
FULL = dict(duration=120.0, drain=90.0, senders=2, consumers=2, sidecar_kill_s=(4.0, 10.0),
            client_kill_s=(3.0, 8.0), sizes="1000,65536,300000,1200000,4000000", attack_pause_s=3.0,
            metrics_extra=48, proxy_stalled=60, hold_s=4.0)
MEMORY_CAP = 256 << 20          # --max-total-bytes
SIDECAR_ARGS = ["--max-total-bytes", str(MEMORY_CAP), "--max-peer-bytes", "128MiB", "--resume-timeout-s", "60",
                "--lease-s", "600"]
HELLO_TIMEOUT_S = 5.0           # the sidecars' default --hello-timeout-s (the metrics port's header timeout)
NOFILE = 1024                   # the sidecars' RLIMIT_NOFILE
RSS_FIXED = 48 << 20            # besides 1.5x the cap and the idle process: frames in flight, allocator
SAMPLE_S = 0.1                  # local Stats and /proc samples of each sidecar, this often
PREFILLS, DECODES, MEMORY_ONLY = ("p0", "p1"), ("d0", "d1"), ("d1",)
MiB = 1 << 20
EMFILE = re.compile(r"Too many open files|EMFILE|out of system resource", re.I)     # as tests/kvflow/test_port_limits.py


def _proc_status(pid: int) -> dict:
    """VmRSS, VmHWM (KiB) and Threads of ``pid``, and its descriptors (fds); {} when it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "Threads"):
                    out[key] = int(value.split()[0])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError, IndexError):
        return {}
    return out


class Sampler(threading.Thread):
    """One sidecar's local Stats latency and its process's RSS, peak RSS and descriptors, every SAMPLE_S.
    A Stats sample counts only if the same life of the sidecar was up (not being killed or restarted) from
    before the call to after it; the first call of each life (the channel's connection) is not counted."""

    def __init__(self, soak: "Soak", name: str):
        super().__init__(daemon=True, name=f"sampler-{name}")
        self.soak, self.name = soak, name
        self.samples, self.failures = [], []
        self.idle_kib, self.peak_kib, self.peak_fds, self.peak_threads = [], 0, 0, 0
        self.peak_at, self.budget_peak = 0.0, 0        # when the peak RSS was seen; the memory budget's peak
        self.halt = threading.Event()

    def run(self) -> None:
        from ciuicflow.kvflow import Client, KVFlowError
        client, life = None, None
        while not self.halt.wait(SAMPLE_S):
            now = self.soak.alive.get(self.name)
            if now is None:
                continue
            st = _proc_status(now[1])
            if st:
                if st.get("VmHWM", 0) > self.peak_kib:
                    self.peak_kib, self.peak_at = st["VmHWM"], time.monotonic()
                self.peak_fds = max(self.peak_fds, st["fds"])
                self.peak_threads = max(self.peak_threads, st.get("Threads", 0))
            if now != life:
                if client is not None:
                    client.close()
                client, life = Client(self.soak.sidecars[self.name].api), now
                try:
                    client.stats()          # connect; not counted
                    if st:
                        self.idle_kib.append(st["VmRSS"])
                except KVFlowError:
                    life = None
                continue
            t0 = time.monotonic()
            try:
                stats = client.stats()
                ok = True
                self.budget_peak = max(self.budget_peak, stats["memory"]["peak"])
            except KVFlowError as exc:
                ok, err = False, exc
            took = time.monotonic() - t0
            if self.soak.alive.get(self.name) != life:
                continue                    # killed meanwhile: says nothing about the floods
            if ok:
                self.samples.append((self.name, t0, took))
            else:
                self.failures.append((self.name, t0, f"{err.code.name}: {err}"[:200]))
        if client is not None:
            client.close()


# Sets the descriptor limit, then becomes the sidecar (same pid). Not a preexec_fn: this process has gRPC
# threads (the samplers), and Python code run between fork and exec can then deadlock or abort.
_NOFILE_EXEC = ("import os, resource, sys; n, hard = int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
                "n = n if hard == resource.RLIM_INFINITY else min(n, hard); "
                "resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard)); "
                "os.execv(sys.executable, [sys.executable] + sys.argv[2:])")


def _limited(nofile: int):
    """A SidecarProcess launcher: the sidecar in a session of its own, under RLIMIT_NOFILE ``nofile``."""
    def launch(argv, **kw):
        return subprocess.Popen([argv[0], "-c", _NOFILE_EXEC, str(nofile)] + argv[1:], cwd=REPO, env=child_env(),
                                start_new_session=True, **kw)
    return launch


class Soak:
    def __init__(self, cfg: dict, workdir: str, seed: int):
        self.cfg, self.dir, self.rng = cfg, workdir, random.Random(seed)
        self.seed = seed
        self.ledger_dir = os.path.join(workdir, "ledger")
        self.logs = os.path.join(workdir, "logs")
        os.makedirs(self.ledger_dir)
        os.makedirs(self.logs)
        self.chaos = Ledger(os.path.join(self.ledger_dir, "chaos.jsonl"))
        self.ports = {n: {"api": free_port(), "listen": free_port(), "metrics": free_port()}
                      for n in PREFILLS + DECODES}
        self.sidecars, self.starts, self.workers = {}, {}, {}
        self.stopped: set[str] = set()  # workers the drain has finished with (not crashes)
        self.stop_files = {role: os.path.join(workdir, f"stop-{role}")
                           for role in ("sender", "consumer", "garbage", "attacker")}
        self.token_file = new_token_file(workdir)
        self.alive: dict = {}           # sidecar -> (start number, pid) while up; None while killed or starting
        self.samplers = {n: Sampler(self, n) for n in PREFILLS + DECODES}

    # ------------------------------------------------------------------ processes
    def _sidecar(self, name: str) -> SidecarProcess:
        ports = self.ports[name]
        peers = DECODES if name in PREFILLS else PREFILLS
        args = SIDECAR_ARGS + ["--metrics-port", str(ports["metrics"]), "--token-file", self.token_file]
        if name not in MEMORY_ONLY and name in DECODES:
            spool = os.path.join(self.dir, f"spool-{name}")
            os.makedirs(spool, mode=0o700, exist_ok=True)
            args += ["--spool-dir", spool]
        self.starts[name] = self.starts.get(name, 0) + 1
        log = os.path.join(self.logs, f"{name}.{self.starts[name]}.log")
        return SidecarProcess(name, f"127.0.0.1:{ports['listen']}",
                              {p: f"127.0.0.1:{self.ports[p]['listen']}" for p in peers}, log, args,
                              api=f"127.0.0.1:{ports['api']}", launch=_limited(NOFILE))

    def start_sidecar(self, name: str) -> None:
        self.alive[name] = None
        sc = self._sidecar(name).start()
        self.sidecars[name] = sc
        sc.wait_ready(60)
        self.alive[name] = (self.starts[name], sc.proc.pid)

    def _worker_argv(self, role: str, name: str):
        base = [sys.executable, *WORKERS, role, "--name", name, "--ledger", self.ledger_dir,
                "--stop", self.stop_files.get(role, ""), "--seed", str(self.seed)]
        if role == "sender":
            src = name.split("-")[0]
            return base + ["--api", self.sidecars[src].api, "--src", src, "--dests", ",".join(DECODES),
                           "--sizes", self.cfg["sizes"]]
        if role == "consumer":
            dest = name.split("-")[0]
            return base + ["--api", self.sidecars[dest].api, "--dest", dest]
        if role in ATTACKER_ROLES:
            targets = [{"name": n, "api": f"127.0.0.1:{p['api']}", "listen": f"127.0.0.1:{p['listen']}",
                        "metrics": p["metrics"], "peers": list(DECODES if n in PREFILLS else PREFILLS)}
                       for n, p in self.ports.items()]
            return [sys.executable, *ATTACKERS, role, "--ledger", self.ledger_dir, "--stop",
                    self.stop_files["attacker"], "--seed", str(self.seed), "--logs", self.logs,
                    "--targets", json.dumps(targets), "--token-file", self.token_file,
                    "--pause", str(self.cfg["attack_pause_s"]), "--extra", str(self.cfg["metrics_extra"]),
                    "--header-timeout-s", str(HELLO_TIMEOUT_S), "--hold-s", str(self.cfg["hold_s"]),
                    "--proxy-stalled", str(self.cfg["proxy_stalled"])]
        targets = [{"api": p["api"], "listen": p["listen"], "metrics": p["metrics"],
                    "data": self.data_ports.get(n, 0)} for n, p in self.ports.items()]
        return base + ["--targets", json.dumps(targets)]

    def start_worker(self, role: str, name: str) -> None:
        log = open(os.path.join(self.logs, f"{name}.log"), "ab")
        proc = subprocess.Popen(self._worker_argv(role, name), cwd=REPO, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.workers[name] = (role, proc, log)

    def kill(self, who: str, proc) -> None:
        if who in self.alive:
            self.alive[who] = None      # before the kill: a Stats sample across it is not counted
        self.chaos.write("kill", who=who)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    # ------------------------------------------------------------------ phases
    def start(self) -> None:
        for name in PREFILLS + DECODES:
            self.sidecars[name] = self._sidecar(name).start()
        for name, sc in self.sidecars.items():
            sc.wait_ready(60)
            self.alive[name] = (self.starts[name], sc.proc.pid)
        for sampler in self.samplers.values():
            sampler.start()
        from ciuicflow.kvflow import Client
        self.data_ports = {n: Client(sc.api).stats().get("data_port") or 0 for n, sc in self.sidecars.items()}
        for p in PREFILLS:
            for i in range(self.cfg["senders"]):
                self.start_worker("sender", f"{p}-s{i}")
        for d in DECODES:
            for i in range(self.cfg["consumers"]):
                self.start_worker("consumer", f"{d}-c{i}")
        self.start_worker("garbage", "garbage")
        for role in self.cfg.get("attackers", ATTACKER_ROLES):
            self.start_worker(role, role)

    def _check_crashes(self) -> None:
        for name, sc in self.sidecars.items():
            if sc.proc.poll() is not None:
                self.alive[name] = None
                self.chaos.write("crash", who=name, code=sc.proc.returncode)
                print(f"  sidecar {name} exited by itself ({sc.proc.returncode}); restarting", flush=True)
                self.start_sidecar(name)
        for name, (role, proc, log) in list(self.workers.items()):
            if name in self.stopped:
                continue
            if proc.poll() not in (None, 0):        # a client that failed by itself: the Client let it down
                self.chaos.write("worker_crash", who=name, code=proc.returncode)
                print(f"  {role} {name} exited by itself ({proc.returncode}); restarting", flush=True)
                log.close()
                self.start_worker(role, name)

    def run(self) -> None:
        end = time.monotonic() + self.cfg["duration"]
        next_sidecar = time.monotonic() + self.rng.uniform(*self.cfg["sidecar_kill_s"])
        next_client = time.monotonic() + self.rng.uniform(*self.cfg["client_kill_s"])
        while time.monotonic() < end:
            time.sleep(0.1)
            self._check_crashes()
            now = time.monotonic()
            if now >= next_sidecar:
                name = self.rng.choice(PREFILLS + DECODES)
                self.kill(name, self.sidecars[name].proc)
                time.sleep(self.rng.uniform(0.2, 1.5))
                self.start_sidecar(name)
                next_sidecar = time.monotonic() + self.rng.uniform(*self.cfg["sidecar_kill_s"])
            if now >= next_client:
                name = self.rng.choice([n for n, (role, _, _) in self.workers.items()
                                        if role in ("sender", "consumer")])
                role, proc, log = self.workers[name]
                self.kill(name, proc)
                log.close()
                self.start_worker(role, name)
                next_client = time.monotonic() + self.rng.uniform(*self.cfg["client_kill_s"])

    def drain(self) -> None:
        """Senders finish what they started (no new transfers), then consumers take what was acknowledged."""
        for role in ("sender", "garbage", "attacker"):
            open(self.stop_files[role], "w").close()
        deadline = time.monotonic() + self.cfg["drain"]
        for name, (role, proc, _) in self.workers.items():
            if role in ("sender", "garbage") + ATTACKER_ROLES:
                try:
                    proc.wait(max(deadline - time.monotonic(), 1.0))
                except subprocess.TimeoutExpired:  # recorded; its open transfers were never acknowledged
                    self.chaos.write("drain_timeout", who=name)
                    print(f"  {role} {name} did not finish within the drain; killed", flush=True)
                    self.kill(name, proc)
                self.stopped.add(name)
            self._check_crashes()
        while time.monotonic() < deadline:
            events = read_all(self.ledger_dir)
            if {e["key"] for e in events if e["ev"] == "ok"} <= acked_keys(events):
                break
            self._check_crashes()
            time.sleep(0.5)
        open(self.stop_files["consumer"], "w").close()

    def stop(self) -> None:
        """Every process ends here, whatever failed before (a post-mortem that fails must not leave the
        sidecars and workers running)."""
        from ciuicflow.kvflow import Client
        for sampler in self.samplers.values():
            sampler.halt.set()
        for sampler in self.samplers.values():
            if sampler.is_alive():
                sampler.join(15)
        for name, sc in self.sidecars.items():      # for the record (and a post-mortem)
            if sc.api is None:
                continue
            try:
                with open(os.path.join(self.logs, f"{name}.stats.json"), "w") as fh:
                    json.dump(Client(sc.api).stats(), fh, indent=1)
            except Exception as exc:            # noqa: BLE001 - for the record only
                print(f"  no final Stats of {name}: {exc!r}"[:200], flush=True)
        for role, proc, log in self.workers.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
            log.close()
        for sc in self.sidecars.values():
            sc.stop()

    def memory(self) -> dict:
        """Per sidecar: its idle RSS (the smallest seen just after a start), peak RSS (VmHWM, over all its
        lives), the bound (1.5x the memory cap + idle + RSS_FIXED), peak descriptors and threads."""
        out = {}
        for name, sm in self.samplers.items():
            idle = min(sm.idle_kib, default=0) / 1024
            out[name] = {"idle_mib": round(idle, 1), "peak_mib": round(sm.peak_kib / 1024, 1),
                         "bound_mib": round(1.5 * MEMORY_CAP / MiB + idle + RSS_FIXED / MiB, 1),
                         "cap_mib": MEMORY_CAP // MiB, "budget_peak_mib": round(sm.budget_peak / MiB, 1),
                         "peak_at": sm.peak_at, "peak_fds": sm.peak_fds, "nofile": NOFILE,
                         "peak_threads": sm.peak_threads}
        return out

    def tracebacks(self) -> int:
        return self._in_logs(lambda text: text.count("Traceback"))

    def out_of_descriptors(self) -> int:
        """Lines of the sidecars' logs that say they ran out of descriptors (the caps should never let them)."""
        return self._in_logs(lambda text: len(EMFILE.findall(text)))

    def _in_logs(self, count) -> int:
        n = 0
        for name in os.listdir(self.logs):
            if name[:2] in ("p0", "p1", "d0", "d1") and name.count(".") == 2:
                with open(os.path.join(self.logs, name), errors="replace") as fh:
                    n += count(fh.read())
        return n


def _kv(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))


def _ms(s: dict) -> str:
    return f"{s['p50_ms']:g}/{s['p90_ms']:g}/{s['worst_ms']:g} (n {s['n']})" if s["n"] else "-"


def table(v: dict) -> str:
    """The attackers, the sidecars' memory and Stats, and the ledger, as text."""
    pad = " " * 52
    lines = ["", f"{'attacker':<9} {'rounds':>11} {'legit':>6}  {'Stats ms p50/p90/worst':<22}  what it did, "
                 "what the sidecar or proxy did"]
    for name, a in v["attacks"].items():
        rounds = f"{a['rounds']}" + (f" ({a['interrupted']} kill)" if a["interrupted"] else "")
        lines.append(f"{name:<9} {rounds:>11} {a['legit_ok']:>6}  {_ms(a['stats_during']):<22}  did: {_kv(a['did'])}")
        lines.append(f"{pad}got: {_kv(a['got'])}")
        extra = {k: x for k, x in a["extra"].items() if not isinstance(x, list)}
        if extra:
            lines.append(f"{pad}{_kv(extra)}")
        lines += [f"{pad}BAD: {b}" for b in a["bad"][:5]]
    lines.append(f"{'(none)':<9} {'':>11} {'':>6}  {_ms(v['stats_outside_floods']):<22}  local Stats outside "
                 "every flood, for comparison")
    lim = v["stats_limits_ms"]
    lines.append(f"Stats during floods: median within {lim['median']:g} ms and none over {lim['worst']:g} ms "
                 f"(judged); calls over {lim['median']:g} ms: " + ", ".join(
                     f"{n} {a['stats_during']['over_limit']} of {a['stats_during']['n']}"
                     for n, a in v["attacks"].items() if a["stats_during"]["n"]))
    lines += ["", f"{'sidecar':<8} {'idle MiB':>9} {'peak MiB':>9} {'bound MiB':>10} {'budget MiB':>11} "
                  f"{'peak fds':>9}  {'Stats ms p50/p90/worst':<26}  attackers at the peak"]
    for name, m in v["memory"].items():
        lines.append(f"{name:<8} {m['idle_mib']:>9g} {m['peak_mib']:>9g} {m['bound_mib']:>10g} "
                     f"{m['budget_peak_mib']:>11g} {m['peak_fds']:>4}/{m['nofile']:<4}  "
                     f"{_ms(v['stats_all'][name]):<26}  {', '.join(m['peak_during']) or '-'}")
    lines += ["", f"ledger: {v['acknowledged']} acknowledged, {len(v['lost'])} lost, {len(v['duplicates'])} "
                  f"duplicated, {len(v['corrupted'])} corrupted, {len(v['crashes'])} sidecar crashes, {v['kills']} "
                  f"kills; attackers' targets {'held' if not v['attack_failures'] else 'MISSED'}"]
    lines += [f"  FAILED: {w}" for w in v["attack_failures"][:20]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CI: a short run, about a minute")
    p.add_argument("--duration", type=float, help="seconds of faults (default 120; --smoke: 30)")
    p.add_argument("--attackers", default=",".join(ATTACKER_ROLES),
                   help="which attackers run (comma-separated; '' for none): " + ", ".join(ATTACKER_ROLES))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the verdict here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, ledger, spools)")
    a = p.parse_args(argv)
    cfg = dict(SMOKE if a.smoke else FULL)
    if a.duration:
        cfg["duration"] = a.duration
    cfg["attackers"] = [x for x in a.attackers.split(",") if x]
    unknown = set(cfg["attackers"]) - set(ATTACKER_ROLES)
    if unknown:
        p.error(f"unknown attackers: {sorted(unknown)}")
    workdir = tempfile.mkdtemp(prefix="kvflow-soak-")
    soak = Soak(cfg, workdir, a.seed)
    t0 = time.monotonic()
    print(f"kvflow soak: {cfg['duration']:g}s of faults, work directory {workdir}", flush=True)
    try:
        soak.start()
        soak.run()
        soak.drain()
    finally:
        soak.stop()
    events = read_all(soak.ledger_dir)
    v = verdict(events, MEMORY_ONLY)
    report = attack_report(events)
    samples = [x for sm in soak.samplers.values() for x in sm.samples]
    failures = [x for sm in soak.samplers.values() for x in sm.failures]
    during = stats_during(samples, report, STATS_LIMIT_MS)
    memory = soak.memory()
    for name, m in memory.items():         # which attackers were at that sidecar when its peak RSS was seen
        m["peak_during"] = sorted(a for a, r in report.items() if any(
            target == name and t0 - SAMPLE_S <= m["peak_at"] <= t1 + SAMPLE_S for target, t0, t1 in r["windows"]))
    proxy = next((e for e in events if e["ev"] == "proxy_stopped"), None)
    emfile = soak.out_of_descriptors()
    failed = judge(v, report, during, memory, cfg["attackers"], len(failures), proxy, emfile)
    v.update(seconds=round(time.monotonic() - t0, 1), sidecar_tracebacks=soak.tracebacks(), sidecar_emfile=emfile,
             sidecar_starts=soak.starts,
             attacks={name: {**{k: x for k, x in r.items() if k != "windows"}, "stats_during": during[name]}
                      for name, r in report.items()},
             stats_outside_floods=during["none"],
             stats_limits_ms={"median": STATS_LIMIT_MS, "worst": STATS_STALL_MS},
             proxy={k: x for k, x in (proxy or {}).items() if k not in ("ev", "t")},
             memory=memory,
             stats_all={n: latency_summary([1000 * x[2] for x in sm.samples]) for n, sm in soak.samplers.items()},
             stats_failures=failures[:20], attack_failures=failed, passed=passed(v) and not failed)
    summary = {k: (len(x) if isinstance(x, list) else x) for k, x in v.items()
               if k not in ("attacks", "memory", "stats_all", "proxy", "stats_outside_floods", "stats_limits_ms")}
    print(json.dumps(summary, indent=1), flush=True)
    print(table(v), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(v, fh, indent=1)
    if v["passed"] and not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work directory kept: {workdir}", flush=True)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
