"""Real KV-flow sidecar processes on 127.0.0.1 for tests (``SidecarFactory``: started, waited for,
always cleaned up), a fake clock, ``wait_until``, and a client run as another local user
(``Unprivileged``). The fixtures that hand them out are in conftest.py."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from ciuicflow.kvflow.sidecar.process import READY_RE, free_port  # noqa: F401  (free_port: for the tests)
from ciuicflow.testing.kvflow_faults import sidecar_module
from tests import REPO


def wait_until(condition, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``condition()`` until it holds (AssertionError after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        time.sleep(0.05)


class FakeClock:
    """A simulated clock for the pure parts (scheduler, congestion controller, transfer state machine)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Sidecar:
    """One ``python -m ciuicflow.kvflow.server`` process (ciuicflow.testing.kvflow_faults with fault flags);
    ``restart()`` keeps its ports and flags."""

    def __init__(self, name: str, logdir: pathlib.Path, peers=None, args=(), listen_port=None, env=None):
        self.name = name
        self.env = dict(env or {})
        self.logdir = logdir
        self.peers = dict(peers or {})
        self.args = list(args)
        self.listen_port = listen_port or free_port()
        self.api_port = free_port()
        self.proc = None
        self.api = None
        self.starts = 0
        self.nofile = None          # RLIMIT_NOFILE of the process (None: this process's)
        self._clients = []

    @property
    def listen(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    @property
    def log_path(self) -> pathlib.Path:
        return self.logdir / f"{self.name}.{self.starts}.log"

    def start(self) -> "Sidecar":
        self.starts += 1
        # a sidecar with fault flags runs through the tests' launcher; production's entry knows no faults
        cmd = [sys.executable, "-m", sidecar_module(self.args), "--name", self.name,
               "--api", f"127.0.0.1:{self.api_port}", "--listen", self.listen]
        for peer, addr in self.peers.items():
            cmd += ["--peer", f"{peer}={addr}"]
        cmd += self.args
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(self.env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=self._limits if self.nofile else None)
        return self

    def _limits(self) -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def wait_ready(self, timeout: float = 30.0) -> "Sidecar":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            m = READY_RE.search(text)
            if m:
                self.api = m.group("api")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar {self.name} exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError(f"sidecar {self.name} not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def client(self, **kwargs):
        from ciuicflow.kvflow import Client
        c = Client(self.api, **kwargs)
        self._clients.append(c)
        return c

    def stats(self) -> dict:
        return self.client().stats()

    def api_metadata(self):
        """The metadata a raw call on the local API needs: the token this sidecar published for our user."""
        from ciuicflow.kvflow.proto.runtime import find_api_token
        token = find_api_token(self.api)
        return (("authorization", f"Bearer {token}"),) if token else ()

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        return self.proc.returncode

    def restart(self) -> "Sidecar":
        self.kill9()
        return self.start().wait_ready()

    def cleanup(self) -> None:
        for c in self._clients:
            try:
                c.close()
            except Exception:
                pass
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()


class SidecarFactory:
    free_port = staticmethod(free_port)

    def __init__(self, logdir: pathlib.Path):
        self.logdir = logdir
        self.all = []

    def make(self, name, peers=None, args=(), listen_port=None, env=None) -> Sidecar:
        sc = Sidecar(name, self.logdir, peers, args, listen_port, env)
        self.all.append(sc)
        return sc

    def pair(self, a_args=(), b_args=()):
        """Sidecars 'a' and 'b', each the other's peer, started together and ready."""
        a = self.make("a", args=a_args)
        b = self.make("b", args=b_args)
        a.peers = {"b": b.listen}
        b.peers = {"a": a.listen}
        for sc in (a, b):
            sc.start()
        for sc in (a, b):
            sc.wait_ready()
        return a, b

    def start_all(self, *sidecars):
        for sc in sidecars:
            sc.start()
        for sc in sidecars:
            sc.wait_ready()

    def cleanup(self, dump: bool = False):
        for sc in self.all:
            sc.cleanup()
        if dump:
            for sc in self.all:
                sys.stderr.write(f"\n----- log of sidecar {sc.name} -----\n{sc.log()[-4000:]}\n")


class Unprivileged:
    """Runs Python code as an unprivileged local user (an attacker beside the sidecar's user), with this
    checkout and this environment's packages importable (an interpreter of the same version that the user
    may execute: this one may sit in a directory only root can enter)."""

    def __init__(self, user: str):
        import shutil
        import sysconfig
        self.user = user
        self.runuser = shutil.which("runuser")
        self.path = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        for python in (sys.executable, f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
            if subprocess.run([self.runuser, "-u", user, "--", python, "-c", "import grpc"], cwd="/",
                              env=self._env(), capture_output=True).returncode == 0:
                self.python = python
                return
        pytest.skip(f"no Python {version} that user {user} may run with this environment's packages")

    def _env(self, extra=None):
        return {"PATH": "/usr/bin:/bin", "PYTHONPATH": self.path, "HOME": "/nonexistent", **(extra or {})}

    def run(self, code: str, timeout: float = 60.0, env=None) -> subprocess.CompletedProcess:
        return subprocess.run([self.runuser, "-u", self.user, "--", self.python, "-c", code], cwd="/",
                              env=self._env(env), capture_output=True, text=True, timeout=timeout)
