"""A real etcd process on loopback for the discovery tests: free ports, a data directory of its own,
stopped (and restartable on the same ports and data) by the test."""
import os
import shutil
import signal
import subprocess
import time

import pytest

from ciuicflow.kvflow.sidecar.process import free_port

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


def require_etcd() -> str:
    if ETCD is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server): discovery needs a real etcd")
    return ETCD


class Etcd:
    def __init__(self, tmp_path):
        self.binary = require_etcd()
        self.dir = tmp_path / "etcd"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "/ciuicflow") -> str:
        return f"etcd://{self.endpoint}{prefix}"

    def start(self, timeout: float = 20.0) -> "Etcd":
        self.starts += 1
        url = f"http://{self.endpoint}"
        self.log_path = self.dir.parent / f"etcd.{self.starts}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_port}",
             "--initial-cluster", f"test=http://127.0.0.1:{self.peer_port}"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while b"ready to serve client requests" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        return self

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()


@pytest.fixture
def etcd(tmp_path):
    server = Etcd(tmp_path).start()
    yield server
    server.stop(signal.SIGKILL)
