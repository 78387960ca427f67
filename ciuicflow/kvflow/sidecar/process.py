"""A sidecar as a child process (``python -m ciuicflow.kvflow.server``), ready once it logs its ready line:
for the kv-demo, benchmarks and scripts."""
from __future__ import annotations

import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_RE = re.compile(r"sidecar '(?P<name>[^']+)' ready: api=(?P<api>\S+) listen=(?P<listen>\S+)")


def log_tail(path: str, n: Optional[int] = 3000) -> str:
    """The last ``n`` characters of a log file (None: all of it; "" while it does not exist)."""
    try:
        with open(path, errors="replace") as fh:
            text = fh.read()
    except FileNotFoundError:
        return ""
    return text if n is None else text[-n:]


_handed_out: set = set()
_random = random.Random()      # its own generator: a test seeding `random` must not make two runs pick alike


def _ephemeral_low() -> int:
    """Where the kernel's range for ``bind(0)`` and outgoing connections starts (Linux; the IANA
    range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 now, never returned before by this process, and outside the kernel's
    ephemeral range. Why outside: a port picked now is bound later by a child process, and meanwhile any
    ``bind(0)`` (a sidecar's data plane) or outgoing connection may be handed the same ephemeral port, so the
    child fails with "Address already in use". Ports below the ephemeral range are only ever taken by name."""
    low = _ephemeral_low()
    first = 10000 if low > 12000 else 1024
    if low - first >= 1000:
        for _ in range(1000):
            port = _random.randrange(first, low)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    for _ in range(1000):          # no room below the ephemeral range: the kernel's choice, never repeated
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no fresh free port on 127.0.0.1 after 1000 tries")


def child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def new_token_file(directory: str) -> str:
    """A fresh shared peer token in ``directory`` (mode 0600), for ``--token-file``: sidecars that listen on a
    network address (not loopback) refuse to start without a peer credential (docs/security.md)."""
    path = os.path.join(directory, "peer-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(32) + "\n")
    return path


class SidecarProcess:
    """One ``python -m MODULE`` process, ``ciuicflow.kvflow.server`` unless told (tests and benchmarks run
    one with faults as ``ciuicflow.testing.kvflow_faults``). ``launch(argv, stdout=...)`` starts it (default:
    subprocess.Popen here; the benchmark passes SimCluster.popen to start it inside a network namespace)."""

    def __init__(self, name: str, listen: str, peers: Dict[str, str], log_path: str, args=(),
                 api: str = "127.0.0.1:0", launch: Optional[Callable] = None,
                 module: str = "ciuicflow.kvflow.server"):
        self.name = name
        self.listen = listen
        self.peers = dict(peers)
        self.log_path = log_path
        self.args = [str(a) for a in args]
        self.api_arg = api
        self.module = module
        self.api: Optional[str] = None          # the bound address, from the ready line
        self._launch = launch
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def argv(self) -> List[str]:
        cmd = [sys.executable, "-m", self.module, "--name", self.name, "--api", self.api_arg,
               "--listen", self.listen]
        for peer, addr in self.peers.items():
            cmd += ["--peer", f"{peer}={addr}"]
        return cmd + self.args

    def start(self) -> "SidecarProcess":
        self._log = open(self.log_path, "wb")
        if self._launch is not None:
            self.proc = self._launch(self.argv(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        else:
            self.proc = subprocess.Popen(self.argv(), cwd=REPO_ROOT, env=child_env(), stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def log(self) -> str:
        return log_tail(self.log_path, None)

    def wait_ready(self, timeout: float = 60.0) -> "SidecarProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY_RE.search(self.log())
            if m:
                self.api = m.group("api")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar {self.name} exited with code {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"sidecar {self.name} not ready after {timeout:g}s:\n{self.log()[-3000:]}")

    def terminate(self) -> None:
        """Ask it to shut down (graceful: SIGTERM) without waiting; ``stop()`` waits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
