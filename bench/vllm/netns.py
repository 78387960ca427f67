"""bench/vllm/serve.py on a tc-shaped link: the prefill side (its sidecar, ``vllm serve``, the proxy and the
load generator) in one network namespace, the decode side (sidecar, ``vllm serve``) in another, joined by
ciuicflow/testing/cluster.py's veth/bridge link shaped with tbf. Only the sidecars' KV traffic and the proxy's
HTTP to the decode server cross the link. Nothing here is reachable from the host's loopback, so the load
generator runs inside the prefill namespace (``vllm_serve.py --client SPEC``) and readiness is read from logs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial

from ciuicflow.testing.cluster import SimCluster
from ciuicflow.integrations.vllm.servers import VllmServer, kv_transfer_config
from ciuicflow.kvflow.sidecar.process import REPO_ROOT, SidecarProcess, log_tail, new_token_file

API_P, API_D, LISTEN, VLLM_P, VLLM_D, PROXY = 50151, 50151, 50152, 8100, 8200, 8000   # per namespace


def _pin(core: int, pin: bool) -> dict:
    """vLLM's CPU worker on one core of its own (one OpenMP thread): by default both servers bind their
    OpenMP threads to every core, and on a small host the two workers' spinning threads slow each other."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core)} if pin and (os.cpu_count() or 1) > core else {}


class NetnsDeployment:
    def __init__(self, cluster: SimCluster, python: str, model_dir: str, kind: str, workdir: str,
                 sidecar_args=(), pin_cores: bool = False):
        self.c, self.workdir = cluster, workdir
        a0, a1 = cluster.node_addr(0), cluster.node_addr(1)
        # the nodes' addresses are not loopback: the sidecars need a peer credential there
        sidecar_args = list(sidecar_args) + ["--token-file", new_token_file(workdir)]
        self.sc_p = SidecarProcess("prefill0", f"{a0}:{LISTEN}", {"decode0": f"{a1}:{LISTEN}"},
                                   os.path.join(workdir, "sidecar-prefill0.log"), args=sidecar_args,
                                   api=f"127.0.0.1:{API_P}", launch=partial(cluster.popen, 0))
        self.sc_d = SidecarProcess("decode0", f"{a1}:{LISTEN}", {"prefill0": f"{a0}:{LISTEN}"},
                                   os.path.join(workdir, "sidecar-decode0.log"), args=sidecar_args,
                                   api=f"127.0.0.1:{API_D}", launch=partial(cluster.popen, 1))
        self.prefill = VllmServer("prefill", python, model_dir, kind, os.path.join(workdir, "vllm-prefill.log"),
                                  kv_transfer_config("kv_producer", f"127.0.0.1:{API_P}", peer="decode0",
                                                     name="prefill0"), port=VLLM_P, launch=partial(cluster.popen, 0),
                                  env=_pin(0, pin_cores))
        self.decode = VllmServer("decode", python, model_dir, kind, os.path.join(workdir, "vllm-decode.log"),
                                 kv_transfer_config("kv_consumer", f"127.0.0.1:{API_D}", name="decode0"),
                                 port=VLLM_D, host="0.0.0.0", launch=partial(cluster.popen, 1), env=_pin(1, pin_cores))
        self.proxy_log = os.path.join(workdir, "proxy.log")
        self.proxy = None
        self.proxy_url = f"http://127.0.0.1:{PROXY}"

    def start(self, timeout: float = 600.0) -> "NetnsDeployment":
        for sc in (self.sc_p, self.sc_d):
            sc.start()
        for sc in (self.sc_p, self.sc_d):
            sc.wait_ready(60)
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready(timeout)
        log = open(self.proxy_log, "wb")
        self.proxy = self.c.popen(0, [sys.executable, "-m", "ciuicflow.integrations.vllm.proxy", "--port", PROXY,
                                      "--prefill", f"http://127.0.0.1:{VLLM_P}",
                                      "--decode", f"http://{self.c.node_addr(1)}:{VLLM_D}=decode0"],
                                  cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while "proxy ready" not in log_tail(self.proxy_log, None):
            if time.monotonic() > deadline or self.proxy.poll() is not None:
                raise RuntimeError(f"proxy did not start:\n{log_tail(self.proxy_log)}")
            time.sleep(0.2)
        return self

    def run_client(self, spec: dict, timeout: float) -> dict:
        """Run the load generator in the prefill namespace; its results."""
        spec_path = os.path.join(self.workdir, "client-spec.json")
        out_path = os.path.join(self.workdir, "client-out.json")
        with open(spec_path, "w") as fh:
            json.dump({**spec, "url": self.proxy_url, "out": out_path}, fh)
        with open(os.path.join(self.workdir, "client.log"), "wb") as log:
            proc = self.c.popen(0, [sys.executable, "-m", "bench.vllm.serve", "--client", spec_path], cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
            if proc.wait(timeout) != 0:
                raise RuntimeError(f"load generator failed:\n{log_tail(os.path.join(self.workdir, 'client.log'))}")
        with open(out_path) as fh:
            return json.load(fh)

    def stop(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.kill()
            self.proxy.wait(10)
        for s in (self.prefill, self.decode):
            s.stop()
        for sc in (self.sc_p, self.sc_d):
            sc.stop()
