"""The KV-flow benchmark's processes, orchestrated: a ``Testbed`` (two sidecars, a sender and a receiver
process beside them, run phase by phase) and the plain gRPC baseline's server (``PlainServer``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from ciuicflow.kvflow.sidecar.process import log_tail
from bench.kvflow.workers import wait_file, write_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
ENTRY = ["-m", "bench.kvflow"]  # workers run as ``python -m bench.kvflow --worker ROLE``


class Testbed:
    """Two sidecars with a sender process beside prefill0 and a receiver process beside decode0."""

    def __init__(self, name, workdir, launches, listens, sidecar_args=((), ()), link_bytes=None):
        from ciuicflow.kvflow.sidecar.process import SidecarProcess
        from ciuicflow.testing.kvflow_faults import sidecar_module
        self.name = name
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.launch = launches
        self.link_bytes = link_bytes or (lambda: None)
        self.sidecars = [
            SidecarProcess("prefill0", listens[0], {"decode0": listens[1]},
                           os.path.join(self.dir, "sidecar-prefill0.log"), args=sidecar_args[0], launch=launches[0],
                           module=sidecar_module(sidecar_args[0])),
            SidecarProcess("decode0", listens[1], {"prefill0": listens[0]},
                           os.path.join(self.dir, "sidecar-decode0.log"), args=sidecar_args[1], launch=launches[1],
                           module=sidecar_module(sidecar_args[1])),
        ]
        self.workers = []
        self.sync = os.path.join(self.dir, "sync")

    def start_sidecars(self):
        for sc in self.sidecars:
            sc.start()

    def start_workers(self, plan: dict, timeout: float):
        for sc in self.sidecars:
            sc.wait_ready(timeout)
        plan_path = os.path.join(self.dir, "plan.json")
        with open(plan_path, "w") as fh:
            json.dump(plan, fh)
        os.makedirs(self.sync, exist_ok=True)
        for k, role in ((0, "sender"), (1, "receiver")):
            log = open(os.path.join(self.dir, f"{role}.log"), "wb")
            argv = [sys.executable, *ENTRY, "--worker", role, "--plan", plan_path,
                    "--api", self.sidecars[k].api, "--sync", self.sync]
            self.workers.append((role, self.launch[k](argv, stdout=log, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL), log))

    def _check_workers(self):
        for role, proc, _ in self.workers:
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"{self.name}: {role} process exited with {proc.returncode}:\n"
                                   f"{log_tail(os.path.join(self.dir, role + '.log'), 2500)}")

    def _wait(self, path: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return wait_file(path, 0.2)
            except TimeoutError:
                self._check_workers()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: {os.path.basename(path)} not written within {timeout:g}s "
                                       f"(see {self.dir})") from None

    def run_phase(self, phase: dict, timeout: float) -> dict:
        name = phase["name"]
        for role in ("sender", "receiver"):
            self._wait(os.path.join(self.sync, f"{name}.{role}.ready"), timeout)
        before = self.link_bytes()
        pids = {f"sidecar {sc.name}": sc.proc.pid for sc in self.sidecars}
        pids.update({role: proc.pid for role, proc, _ in self.workers})
        cpu_before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        t0 = time.monotonic() + 0.3
        write_file(os.path.join(self.sync, f"{name}.go"), repr(t0))
        sent = json.loads(self._wait(os.path.join(self.sync, f"{name}.sender.json"), timeout))
        received = json.loads(self._wait(os.path.join(self.sync, f"{name}.receiver.json"), timeout))
        after = self.link_bytes()
        # per process; includes the workers' wait for "go" (a 10 ms poll)
        cpu = {role: cpu_seconds(pid) - cpu_before[role] for role, pid in pids.items()}
        link = None
        if before is not None and after is not None:
            link = after[0][0] - before[0][0]      # bytes out of node 0 onto its veth
        return {"t0": t0, "sent": sent, "received": received, "link_tx_bytes": link, "cpu_s": sum(cpu.values()),
                "cpu_s_by_process": cpu,
                "sidecar": sent.pop("__sidecar__", None)}

    def stop_workers(self):
        for role, proc, fh in self.workers:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            fh.close()
        self.workers = []


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by a process (Linux /proc; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")     # utime, stime (ticks)
    except (OSError, IndexError, ValueError):
        return 0.0


def host_launch(argv, **kwargs):
    from ciuicflow.kvflow.sidecar.process import child_env
    return subprocess.Popen(argv, cwd=REPO, env=child_env(), start_new_session=True, **kwargs)


class PlainServer:
    """The plain gRPC receiving process (started early: it imports grpc while the sidecars start)."""

    def __init__(self, workdir: str, seed: int):
        self.dir = os.path.join(workdir, "plain")
        os.makedirs(self.dir, exist_ok=True)
        self.port_file = os.path.join(self.dir, "port")
        self._log = open(os.path.join(self.dir, "server.log"), "wb")
        self.proc = host_launch([sys.executable, *ENTRY, "--worker", "plain-server",
                                  "--port-file", self.port_file, "--seed", str(seed)], stdout=self._log, stderr=subprocess.STDOUT)

    def run_once(self, args, requests, rep: int) -> dict:
        """The plain client process sends the same bytes once; its measurement."""
        plan = os.path.join(self.dir, "plan.json")
        with open(plan, "w") as fh:
            json.dump({"seed": args.seed, "phases": [{"requests": requests}]}, fh)
        port = int(wait_file(self.port_file, 120))
        out = os.path.join(self.dir, f"client-{rep}.json")
        log_path = os.path.join(self.dir, f"client-{rep}.log")
        server_cpu = cpu_seconds(self.proc.pid)
        with open(log_path, "wb") as fh:
            rc = host_launch([sys.executable, *ENTRY, "--worker", "plain-client",
                               "--plan", plan, "--address", f"127.0.0.1:{port}", "--out", out],
                              stdout=fh, stderr=subprocess.STDOUT).wait(args.timeout)
        if rc != 0:
            raise RuntimeError(f"plain gRPC client failed ({rc}):\n{log_tail(log_path, 2500)}")
        with open(out) as fh:
            result = json.load(fh)
        result["cpu_s_by_process"] = {"client": result["client_cpu_s"],
                                      "server": cpu_seconds(self.proc.pid) - server_cpu}
        result["cpu_s"] = sum(result["cpu_s_by_process"].values())
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def free_port() -> int:
    from ciuicflow.kvflow.sidecar.process import free_port
    return free_port()
