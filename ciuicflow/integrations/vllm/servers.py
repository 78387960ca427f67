"""vLLM servers as child processes (``vllm serve`` through launcher.py, in vLLM's own environment) and
small OpenAI-API helpers: for the demo, the benchmark and the tests. No vLLM import here."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import time
from typing import Dict, List, Optional

from ciuicflow.kvflow.sidecar.process import REPO_ROOT, child_env, free_port, log_tail

from .model import BLOCK_SIZE, COMPILATION_CONFIG

CONNECTOR = "CiuicFlowConnector"
MODULE = "ciuicflow.integrations.vllm"


def kv_transfer_config(role: str, sidecar: str, **extra) -> dict:
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE, "kv_role": role,
            "kv_connector_extra_config": {"sidecar": sidecar, **extra}}


class VllmServer:
    """One ``vllm serve`` process on 127.0.0.1 (its own process group: stop() ends vLLM's children too)."""

    def __init__(self, name: str, python: str, model_dir: str, kind: str, log_path: str,
                 kv_config: Optional[dict] = None, port: Optional[int] = None, dtype: str = "float32",
                 max_model_len: int = 1024, extra_args: Optional[List[str]] = None,
                 env: Optional[Dict[str, str]] = None, failure_policy: str = "recompute", compile: bool = False,
                 host: str = "127.0.0.1", launch=None):
        self.name, self.python, self.model_dir, self.kind = name, python, model_dir, kind
        self.log_path = log_path
        self.port = port or free_port()
        self.kv_config = dict(kv_config) if kv_config else None
        if self.kv_config is not None:
            self.kv_config.setdefault("kv_load_failure_policy", failure_policy)
        self.dtype, self.max_model_len = dtype, max_model_len
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.compile = compile
        self.host = host                # 0.0.0.0 where a proxy in another network namespace reaches it
        self._launch = launch           # e.g. SimCluster.popen of a node: start it in that namespace
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> List[str]:
        cmd = [self.python, "-m", "ciuicflow.integrations.vllm.launcher", "serve", self.model_dir,
               "--host", self.host, "--port", str(self.port), "--served-model-name", "tiny",
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--block-size", str(BLOCK_SIZE[self.kind]), "--no-enable-prefix-caching",
               "--max-num-seqs", "16", "--seed", "0", "--disable-log-stats"]
        if not self.compile:
            cmd.append("--enforce-eager")       # no torch.compile warm-up: start-up in half the time here
        if COMPILATION_CONFIG[self.kind]:
            cmd += ["--compilation-config", json.dumps(COMPILATION_CONFIG[self.kind])]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd + self.extra_args

    def start(self) -> "VllmServer":
        env = child_env({"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
                         **self.env})
        env.pop("OMP_NUM_THREADS", None)     # vLLM's CPU backend binds its own OpenMP threads
        self._log = open(self.log_path, "ab")
        if self._launch is not None:
            self.proc = self._launch(self.argv(), env=env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        else:
            self.proc = subprocess.Popen(self.argv(), cwd=REPO_ROOT, env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def log(self, n: Optional[int] = 4000) -> str:
        return log_tail(self.log_path, n)

    def wait_ready(self, timeout: float = 300.0) -> "VllmServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if self._launch is not None:        # another namespace: its port is not reachable from here
                if "Application startup complete" in self.log(None):
                    return self
            else:
                try:
                    if get(self.url, "/health", timeout=2)[0] == 200:
                        return self
                except OSError:
                    pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not healthy after {timeout:g}s:\n{self.log()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None


def get(base: str, path: str, timeout: float = 30.0):
    host, port = base.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def complete(base: str, prompt: List[int], max_tokens: int, timeout: float = 300.0, headers=None,
             **fields) -> dict:
    """Greedy /v1/completions with token-id prompts; returns the JSON answer (``tokens`` added: the
    generated token ids) or raises RuntimeError with the server's answer."""
    host, port = base.split("//", 1)[1].split(":")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True, **fields}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                    **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()
    if r.status != 200:
        raise RuntimeError(f"{base} answered {r.status}: {data[:500]!r}")
    out = json.loads(data)
    out["tokens"] = list(out["choices"][0].get("token_ids") or [])
    out["finish_reason"] = out["choices"][0].get("finish_reason")
    out["headers"] = hdrs
    return out


def stream_complete(base: str, prompt: List[int], max_tokens: int, headers=None, timeout: float = 300.0) -> dict:
    """Streaming greedy /v1/completions; returns {ok, ttft_s, tpot_s, tokens, error} measured here (the
    time to the first generated token, and the mean time per later token); ``t_start`` (wall clock),
    ``prefill_s`` and ``key`` (the proxy's ``x-ciuic-prefill-s`` and ``x-ciuic-key``) place the request
    among the servers' phase records (phases.py)."""
    host, port = base.split("//", 1)[1].split(":")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    t0, wall = time.monotonic(), time.time()
    first = last = None
    tokens: List[int] = []
    meta = {"t_start": wall}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                    **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            return {"ok": False, "error": f"{r.status}: {r.read()[:200]!r}", "tokens": []}
        meta["key"] = r.getheader("x-ciuic-key")
        prefill_s = r.getheader("x-ciuic-prefill-s")
        meta["prefill_s"] = float(prefill_s) if prefill_s else None
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            choice = (json.loads(data).get("choices") or [{}])[0]
            new = choice.get("token_ids") or []
            if new:
                now = time.monotonic()
                first = first if first is not None else now
                last = now
                tokens.extend(new)
    except (OSError, ValueError) as exc:
        return {"ok": False, "error": str(exc), "tokens": tokens}
    finally:
        conn.close()
    if first is None:
        return {"ok": False, "error": "no tokens", "tokens": []}
    tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
    return {"ok": True, "ttft_s": first - t0, "tpot_s": tpot, "tokens": tokens, "error": None, **meta}
