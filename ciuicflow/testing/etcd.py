"""A real etcd process on loopback, for tests and benches of discovery: free ports, a data directory of its
own, stopped (and started again on the same ports and data) by its user. ``ETCD``: the binary (None when
etcd is not installed: ``apt-get install -y etcd-server``)."""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import time

from ..kvflow.sidecar.process import free_port

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)


class Etcd:
    def __init__(self, workdir, binary: str = None):
        self.binary = binary or ETCD
        if self.binary is None:
            raise FileNotFoundError("etcd is not installed (apt-get install -y etcd-server)")
        self.dir = pathlib.Path(workdir) / "etcd"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc = None
        self.starts = 0
        self._log = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str = "/ciuicflow") -> str:
        return f"etcd://{self.endpoint}{prefix}"

    def start(self, timeout: float = 30.0) -> "Etcd":
        self.starts += 1
        url = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = self.dir.parent / f"etcd.{self.starts}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}"],
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
        if self._log:
            self._log.close()
            self._log = None
