"""Chaos at scale on one machine: N sidecars on loopback ports that find each other through a real etcd,
while nodes join and leave, a share of them is SIGKILLed every minute (and started again), and etcd itself
is restarted once. Every transfer's outcome goes to a ledger; the verdict: no send hangs past its
timeout, nothing acknowledged is lost, duplicated or corrupted, every failure has a terminal status, and at
the end every node has every other as a peer again.

    python -m bench.soak.chaos --nodes 8 --seconds 120 --json out/kvflow_chaos.json
    python -m bench.soak.chaos --smoke          # 4 nodes, 30 s, one kill, one leave, one join, etcd restart

Receivers spool to disk (--spool-dir), so an acknowledged transfer survives its receiver's death and is
delivered once the receiver is back (docs/kvflow.md, Delivery guarantees). Needs etcd (apt-get install -y
etcd-server). The ledger's verdict is the soak's (bench/soak/ledger.py).
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter

from bench.soak.ledger import Ledger, passed, read_all, verdict

from ciuicflow.kvflow.sidecar.process import SidecarProcess, free_port
from ciuicflow.testing.etcd import Etcd

PREFIX = "/chaos"
SEND_DEADLINE_S = 10.0          # each transfer's deadline (the sidecar fails it after this)
HANG_S = SEND_DEADLINE_S + 10   # a send not answered by then hangs: the verdict fails
SIZES = (64 << 10, 512 << 10, 2 << 20)


def payload(key: str, size: int) -> bytes:
    return hashlib.shake_256(key.encode()).digest(size)


class Node:
    """One sidecar by name: started again under the same name, port and spool after a kill."""

    def __init__(self, name: str, workdir: str, etcd: Etcd, secrets_file: str, ttl: int):
        self.name = name
        self.workdir = workdir
        self.listen = f"127.0.0.1:{free_port()}"
        self.args = ["--discovery", etcd.url(PREFIX), "--discovery-ttl-s", str(ttl), "--peer-secrets-file",
                     secrets_file, "--spool-dir", os.path.join(workdir, f"spool-{name}"), "--drain-s", "2"]
        self.proc = None
        self.starts = 0
        self.up = threading.Event()
        self.lock = threading.Lock()
        self.client = None

    def start(self) -> None:
        from ciuicflow.kvflow import Client
        self.starts += 1
        log = os.path.join(self.workdir, f"{self.name}.{self.starts}.log")
        self.proc = SidecarProcess(self.name, self.listen, {}, log, self.args).start().wait_ready()
        with self.lock:
            self.client = Client(self.proc.api)
        self.up.set()

    def down(self, sig) -> None:
        self.up.clear()
        with self.lock:
            client, self.client = self.client, None
        if self.proc is not None and self.proc.proc.poll() is None:
            self.proc.proc.send_signal(sig)
            self.proc.proc.wait(15)
            self.proc.stop()
        if client is not None:
            client.close()

    def get_client(self):
        with self.lock:
            return self.client


def _secrets(workdir: str, names) -> dict:
    pairs = {frozenset(p): hashlib.sha256(f"{p}-{os.urandom(8).hex()}".encode()).hexdigest()
             for p in itertools.combinations(names, 2)}
    files = {}
    for name in names:
        path = os.path.join(workdir, f"{name}.secrets.toml")
        with open(path, "w") as fh:
            for other in names:
                if other != name:
                    fh.write(f'{other} = "{pairs[frozenset((name, other))]}"\n')
        os.chmod(path, 0o600)
        files[name] = path
    return files


class Chaos:
    def __init__(self, a):
        self.a = a
        self.workdir = tempfile.mkdtemp(prefix="kvflow-chaos-")
        self.ledger_dir = os.path.join(self.workdir, "ledger")
        os.makedirs(self.ledger_dir)
        self.rng = random.Random(a.seed)
        self.etcd = Etcd(self.workdir).start()
        names = [f"n{i}" for i in range(a.nodes)]
        secrets = _secrets(self.workdir, names)
        self.nodes = {n: Node(n, self.workdir, self.etcd, secrets[n], a.ttl) for n in names}
        self.stop_sending = threading.Event()
        self.stop_consuming = threading.Event()
        self.orchestra = Ledger(os.path.join(self.ledger_dir, "orchestrator.jsonl"))
        self.events = []            # what the orchestrator did, for the report

    def note(self, what: str, **fields) -> None:
        self.events.append({"what": what, "t": round(time.monotonic() - self.t0, 2), **fields})
        print(f"[{self.events[-1]['t']:7.2f}s] {what} {fields}", flush=True)

    # ------------------------------------------------------------------ workers
    def sender(self, node: Node) -> None:
        ledger = Ledger(os.path.join(self.ledger_dir, f"sender-{node.name}.jsonl"))
        rng = random.Random(f"{self.a.seed}-{node.name}")
        for n in itertools.count(1):
            if self.stop_sending.is_set():
                return
            client = node.get_client()
            dests = [x for x in self.nodes.values() if x is not node and x.up.is_set()]
            if client is None or not dests:
                time.sleep(0.1)
                continue
            key, size, dest = f"{node.name}-{node.starts}-{n}", rng.choice(SIZES), rng.choice(dests).name
            data = payload(key, size)
            ledger.write("intent", key=key, src=node.name, dest=dest, size=size,
                         sha=hashlib.sha256(data).hexdigest(), priority="normal")
            t0 = time.monotonic()
            try:
                client.send(dest, key, data, deadline_s=SEND_DEADLINE_S, idempotency_key=key).wait(HANG_S)
                ledger.write("ok", key=key, src=node.name, dest=dest, size=size, sha="")
            except TimeoutError:
                ledger.write("hung", key=key, src=node.name, dest=dest, seconds=time.monotonic() - t0)
            except Exception as exc:        # noqa: BLE001 - KVFlowError, or the client closed under it
                code = getattr(getattr(exc, "code", None), "name", type(exc).__name__)
                ledger.write("failed", key=key, src=node.name, dest=dest, code=code,
                             seconds=round(time.monotonic() - t0, 3))
            time.sleep(rng.uniform(0.0, self.a.gap_s))

    def consumer(self, node: Node) -> None:
        """Receives what was acknowledged to this node (manual ack: a kill before the ack gets it again)."""
        from ciuicflow.kvflow import KVFlowError
        ledger = Ledger(os.path.join(self.ledger_dir, f"consumer-{node.name}.jsonl"))
        done = set()
        while True:
            events = read_all(self.ledger_dir)
            oks = {e["key"]: e for e in events if e["ev"] == "ok" and e["dest"] == node.name}
            todo = [k for k in oks if k not in done]
            if not todo and self.stop_consuming.is_set():
                return
            client = node.get_client()
            if client is None or not todo:
                time.sleep(0.2)
                continue
            for key in todo:
                t0 = time.monotonic()
                try:
                    data = client.recv(key, timeout_s=1.0, source=oks[key]["src"], manual_ack=True)
                except (KVFlowError, Exception):    # noqa: BLE001 - its sidecar went down: later
                    break
                data = data if isinstance(data, bytes) else b"".join(data)
                ledger.write("delivered", key=key, t0=t0, sha_ok=data == payload(key, oks[key]["size"]))
                try:
                    client.ack(key, source=oks[key]["src"])
                    ledger.write("acked", key=key)
                    done.add(key)
                except Exception:                   # noqa: BLE001 - received again after the restart
                    break

    # ------------------------------------------------------------------ the schedule
    def kill(self, node: Node, sig=signal.SIGKILL) -> None:
        self.orchestra.write("kill", who=node.name) if sig == signal.SIGKILL else None
        node.down(sig)
        self.note("kill" if sig == signal.SIGKILL else "leave", node=node.name)

    def run(self) -> dict:
        a = self.a
        self.t0 = time.monotonic()
        names = list(self.nodes)
        joiner = names[-1]
        for name in names[:-1]:
            self.nodes[name].start()
        self.note("started", nodes=names[:-1])
        threads = [threading.Thread(target=f, args=(n,), daemon=True)
                   for n in self.nodes.values() for f in (self.sender, self.consumer)]
        for t in threads:
            t.start()
        end = self.t0 + a.seconds
        plan = [(0.2, "join"), (0.4, "leave"), (0.5, "etcd"), (0.6, "rejoin")]
        kill_every = 60.0 / max(a.kill_rate * a.nodes, 1e-9)
        next_kill = self.t0 + min(kill_every, 0.3 * a.seconds)
        left = None
        while time.monotonic() < end:
            now = time.monotonic()
            while plan and now >= self.t0 + plan[0][0] * a.seconds:
                step = plan.pop(0)[1]
                if step == "join":
                    self.nodes[joiner].start()
                    self.note("join", node=joiner)
                elif step == "leave":
                    left = self.rng.choice([n for n in names if n != joiner and self.nodes[n].up.is_set()])
                    self.kill(self.nodes[left], signal.SIGTERM)
                elif step == "etcd":
                    self.etcd.stop(signal.SIGKILL)
                    self.note("etcd killed")
                    time.sleep(a.etcd_down_s)
                    self.etcd.start()
                    self.note("etcd started")
                elif step == "rejoin" and left:
                    self.nodes[left].start()
                    self.note("rejoin", node=left)
            if now >= next_kill:
                victims = [n for n in self.nodes.values() if n.up.is_set() and n.name not in (left,)]
                if len(victims) > 2:
                    victim = self.rng.choice(victims)
                    self.kill(victim)
                    threading.Timer(a.down_s, self._restart, (victim,)).start()
                next_kill = now + kill_every
            time.sleep(0.1)
        for node in self.nodes.values():           # every node back for the drain
            if not node.up.is_set():
                try:
                    node.start()
                except RuntimeError:
                    pass
        self.views = self._views(settle_s=a.ttl + 5)
        self.stop_sending.set()
        time.sleep(SEND_DEADLINE_S + 2)
        self.stop_consuming.set()
        deadline = time.monotonic() + a.drain_s
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic()))
        return self.report()

    def _views(self, settle_s: float) -> dict:
        """Once every node is back: which peers each one lacks (none, within ``settle_s``: a node that some
        peer never takes back is lost to the fleet)."""
        deadline = time.monotonic() + settle_s
        while True:
            missing = {}
            for node in self.nodes.values():
                client = node.get_client()
                peers = set(client.stats()["discovery"]["peers"]) if client is not None else set()
                lacks = sorted(set(self.nodes) - peers - {node.name})
                if lacks:
                    missing[node.name] = lacks
            if not missing or time.monotonic() > deadline:
                self.note("views", missing=missing)
                return missing
            time.sleep(0.5)

    def _restart(self, node: Node) -> None:
        if not node.up.is_set() and not self.stop_sending.is_set():
            node.start()
            self.note("restart", node=node.name)

    def report(self) -> dict:
        events = read_all(self.ledger_dir)
        v = verdict(events)
        outcomes = Counter("ok" if e["ev"] == "ok" else e.get("code", e["ev"])
                           for e in events if e["ev"] in ("ok", "failed", "hung"))
        intents = {e["key"] for e in events if e["ev"] == "intent"}
        terminal = {e["key"] for e in events if e["ev"] in ("ok", "failed", "hung")}
        hung = [e["key"] for e in events if e["ev"] == "hung"]
        fail_s = sorted(e["seconds"] for e in events if e["ev"] == "failed")
        v.update(outcomes=dict(outcomes), hung=hung, unresolved=sorted(intents - terminal),
                 failure_seconds_max=fail_s[-1] if fail_s else 0.0, schedule=self.events,
                 peers_missing_at_end=self.views,
                 nodes=self.a.nodes, seconds=self.a.seconds, ttl=self.a.ttl, workdir=self.workdir)
        v["passed"] = passed(v) and not hung and not v["unresolved"] and not self.views
        return v

    def close(self) -> None:
        for node in self.nodes.values():
            node.down(signal.SIGKILL)
        self.etcd.stop(signal.SIGKILL)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--kill-rate", type=float, default=0.1, help="share of the nodes SIGKILLed per minute")
    p.add_argument("--down-s", type=float, default=4.0, help="a killed node is started again after this")
    p.add_argument("--etcd-down-s", type=float, default=2.0)
    p.add_argument("--ttl", type=int, default=3, help="the sidecars' --discovery-ttl-s")
    p.add_argument("--gap-s", type=float, default=0.2, help="each sender waits up to this between sends")
    p.add_argument("--drain-s", type=float, default=60.0, help="consumers' time to take what is left")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="4 nodes, 30 s, a kill forced within the run")
    p.add_argument("--json", help="write the verdict here")
    a = p.parse_args(argv)
    if a.smoke:
        a.nodes, a.seconds, a.kill_rate, a.drain_s = 4, 30.0, 1.0, 40.0
    chaos = Chaos(a)
    try:
        v = chaos.run()
    finally:
        chaos.close()
    print(json.dumps({k: v[k] for k in ("passed", "outcomes", "acknowledged", "delivered", "lost", "duplicates",
                                        "corrupted", "hung", "unresolved", "kills", "failure_seconds_max",
                                        "peers_missing_at_end")},
                     indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(v, fh, indent=1)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
