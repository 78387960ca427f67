"""KV-flow soak: real sidecars under faults and attack for a bounded time, with a ledger proving that no
acknowledged transfer was lost, none delivered twice and no byte delivered corrupted.

Four sidecars on 127.0.0.1: prefill p0 and p1 send to decode d0 (with --spool-dir: durable) and d1 (memory
only: its senders keep what it holds until its consumers have it). Beside them run client processes
(kvflow_soak_workers.py): senders (deterministic payloads, idempotency keys, retrying until OK), consumers
(manual_ack: receive, check, record, acknowledge) and a garbage process (random bytes, malformed frames and
messages, bad tickets, idle connections on every port of every sidecar). Meanwhile sidecars are killed with
SIGKILL at random and restarted (one at a time, same ports and spool), and so are the client processes.
Then the senders stop, the consumers drain, and the ledger (kvflow_soak_ledger.py) is judged:

* lost: acknowledged to a sender (``wait()`` returned OK) and never delivered intact; a loss the guarantees
  allow (a receiver without spool and its sender both killed before the consumer had it) is counted apart;
* duplicates: a delivery that began after a consumer had acknowledged the transfer;
* corrupted: a delivery whose bytes differ from what was sent;
* crashes: a sidecar that exited without being killed.

    python bench/kvflow_soak.py --smoke --json out/kvflow_soak.json    # CI: under a minute
    python bench/kvflow_soak.py --duration 600                          # longer

Exit status 0 only if nothing was lost, duplicated or corrupted and no sidecar crashed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
from ciuicflow.kvflow.sidecar.process import SidecarProcess, child_env, free_port  # noqa: E402
from kvflow_soak_ledger import Ledger, acked_keys, passed, read_all, verdict  # noqa: E402

WORKERS = os.path.join(HERE, "kvflow_soak_workers.py")
SMOKE = dict(duration=18.0, drain=25.0, senders=1, consumers=1, sidecar_kill_s=(3.0, 5.0),
             client_kill_s=(4.0, 7.0), sizes="1000,65536,300000,1200000")
FULL = dict(duration=120.0, drain=90.0, senders=2, consumers=2, sidecar_kill_s=(4.0, 10.0),
            client_kill_s=(3.0, 8.0), sizes="1000,65536,300000,1200000,4000000")
SIDECAR_ARGS = ["--max-total-bytes", "256MiB", "--max-peer-bytes", "128MiB", "--resume-timeout-s", "60",
                "--lease-s", "600"]
PREFILLS, DECODES, MEMORY_ONLY = ("p0", "p1"), ("d0", "d1"), ("d1",)


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
        self.stop_files = {role: os.path.join(workdir, f"stop-{role}") for role in ("sender", "consumer", "garbage")}

    # ------------------------------------------------------------------ processes
    def _sidecar(self, name: str) -> SidecarProcess:
        ports = self.ports[name]
        peers = DECODES if name in PREFILLS else PREFILLS
        args = SIDECAR_ARGS + ["--metrics-port", str(ports["metrics"])]
        if name not in MEMORY_ONLY and name in DECODES:
            spool = os.path.join(self.dir, f"spool-{name}")
            os.makedirs(spool, mode=0o700, exist_ok=True)
            args += ["--spool-dir", spool]
        self.starts[name] = self.starts.get(name, 0) + 1
        log = os.path.join(self.logs, f"{name}.{self.starts[name]}.log")
        return SidecarProcess(name, f"127.0.0.1:{ports['listen']}",
                              {p: f"127.0.0.1:{self.ports[p]['listen']}" for p in peers}, log, args,
                              api=f"127.0.0.1:{ports['api']}")

    def start_sidecar(self, name: str) -> None:
        sc = self._sidecar(name).start()
        self.sidecars[name] = sc
        sc.wait_ready(60)

    def _worker_argv(self, role: str, name: str):
        base = [sys.executable, WORKERS, role, "--name", name, "--ledger", self.ledger_dir,
                "--stop", self.stop_files[role], "--seed", str(self.seed)]
        if role == "sender":
            src = name.split("-")[0]
            return base + ["--api", self.sidecars[src].api, "--src", src, "--dests", ",".join(DECODES),
                           "--sizes", self.cfg["sizes"]]
        if role == "consumer":
            dest = name.split("-")[0]
            return base + ["--api", self.sidecars[dest].api, "--dest", dest]
        targets = [{"api": p["api"], "listen": p["listen"], "metrics": p["metrics"],
                    "data": self.data_ports.get(n, 0)} for n, p in self.ports.items()]
        return base + ["--targets", json.dumps(targets)]

    def start_worker(self, role: str, name: str) -> None:
        log = open(os.path.join(self.logs, f"{name}.log"), "ab")
        proc = subprocess.Popen(self._worker_argv(role, name), cwd=REPO, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.workers[name] = (role, proc, log)

    def kill(self, who: str, proc) -> None:
        self.chaos.write("kill", who=who)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    # ------------------------------------------------------------------ phases
    def start(self) -> None:
        for name in PREFILLS + DECODES:
            self.sidecars[name] = self._sidecar(name).start()
        for sc in self.sidecars.values():
            sc.wait_ready(60)
        from ciuicflow.kvflow import Client
        self.data_ports = {n: Client(sc.api).stats().get("data_port") or 0 for n, sc in self.sidecars.items()}
        for p in PREFILLS:
            for i in range(self.cfg["senders"]):
                self.start_worker("sender", f"{p}-s{i}")
        for d in DECODES:
            for i in range(self.cfg["consumers"]):
                self.start_worker("consumer", f"{d}-c{i}")
        self.start_worker("garbage", "garbage")

    def _check_crashes(self) -> None:
        for name, sc in self.sidecars.items():
            if sc.proc.poll() is not None:
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
                name = self.rng.choice([n for n, (role, _, _) in self.workers.items() if role != "garbage"])
                role, proc, log = self.workers[name]
                self.kill(name, proc)
                log.close()
                self.start_worker(role, name)
                next_client = time.monotonic() + self.rng.uniform(*self.cfg["client_kill_s"])

    def drain(self) -> None:
        """Senders finish what they started (no new transfers), then consumers take what was acknowledged."""
        for role in ("sender", "garbage"):
            open(self.stop_files[role], "w").close()
        deadline = time.monotonic() + self.cfg["drain"]
        for name, (role, proc, _) in self.workers.items():
            if role in ("sender", "garbage"):
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
        from ciuicflow.kvflow import Client, KVFlowError
        for name, sc in self.sidecars.items():      # for the record (and a post-mortem)
            try:
                with open(os.path.join(self.logs, f"{name}.stats.json"), "w") as fh:
                    json.dump(Client(sc.api).stats(), fh, indent=1)
            except (KVFlowError, OSError):
                pass
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

    def tracebacks(self) -> int:
        n = 0
        for name in os.listdir(self.logs):
            if name[:2] in ("p0", "p1", "d0", "d1") and name.count(".") == 2:
                with open(os.path.join(self.logs, name), errors="replace") as fh:
                    n += fh.read().count("Traceback")
        return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CI: a short run, under a minute")
    p.add_argument("--duration", type=float, help="seconds of faults (default 120; --smoke: 18)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the verdict here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, ledger, spools)")
    a = p.parse_args(argv)
    cfg = dict(SMOKE if a.smoke else FULL)
    if a.duration:
        cfg["duration"] = a.duration
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
    v = verdict(read_all(soak.ledger_dir), MEMORY_ONLY)
    v.update(seconds=round(time.monotonic() - t0, 1), sidecar_tracebacks=soak.tracebacks(),
             sidecar_starts=soak.starts, passed=passed(v))
    summary = {k: (len(x) if isinstance(x, list) else x) for k, x in v.items()}
    print(json.dumps(summary, indent=1), flush=True)
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
