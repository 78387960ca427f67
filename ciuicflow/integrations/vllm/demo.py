"""``ciuicflow vllm-demo``: disaggregated prefill/decode with two real vLLM servers and two sidecars.

Processes on 127.0.0.1: sidecars ``prefill0`` and ``decode0``, a prefill ``vllm serve`` (kv_producer) and a
decode ``vllm serve`` (kv_consumer) with CiuicFlowConnector, and the routing proxy (a thread here). The
model, a tiny DeepSeek-V3 (MLA) or Llama, is built locally from a config (random weights). Each prompt is
decoded greedily through the proxy (prefill with max_tokens=1 on one server, KV through the sidecars layer
by layer, decode on the other; all prompts at once, so several requests share each step) and, as the
reference, by the decode server alone (no kv_transfer_params: it prefills and decodes in one instance;
prefix caching is off, so nothing carries over). Exits 0 only if every prompt's tokens are equal and every
disaggregated request loaded its KV through the connector (the decode sidecar received one transfer per
request; the decode server's connector logged one successful load per request and no failure).

Run in vLLM's environment: ``bash scripts/vllm_demo.sh`` creates it and runs this.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from ciuicflow.kvflow.sidecar.process import REPO_ROOT, SidecarProcess, child_env, free_port

from .model import BLOCK_SIZE, VOCAB
from .servers import VllmServer, complete, kv_transfer_config

LOADED_RE = re.compile(r"loaded KV of request (\S+)")
FAILED_RE = re.compile(r"KV load of request (\S+) .*failed")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="deepseek", choices=("deepseek", "llama"),
                   help="tiny DeepSeek-V3 (MLA; default) or Llama, built locally")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompts", type=int, default=6, help="number of prompts (default 6)")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens decoded per prompt (default 12)")
    p.add_argument("--load-mode", default="async", choices=("async", "layerwise"),
                   help="decode side: load between steps (default) or wait per layer in the first forward")
    p.add_argument("--python", default=None, help="the interpreter of vLLM's environment (default: this one)")
    p.add_argument("--models-dir", default=None, help="where built models are kept (default ~/.cache/ciuicflow)")
    p.add_argument("--workdir", default=None, help="logs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for server start-up and requests")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


def prompt_lengths(n: int, block: int):
    """Shorter than a block, exactly one, just over, several blocks: cycled for n prompts."""
    base = [5, block, block + 3, 2 * block + 7, 3 * block + 1, block - 1, 4 * block + 9]
    return [base[i % len(base)] + (i // len(base)) for i in range(n)]


def make_prompts(n: int, block: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in prompt_lengths(n, block)]


def build_model(python: str, kind: str, dtype: str, models_dir: str) -> str:
    out = os.path.join(models_dir, f"{kind}-{dtype}")
    r = subprocess.run([python, "-m", "ciuicflow.integrations.vllm.model", kind, out, "--dtype", dtype],
                       cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"building the {kind} model failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return out


class Deployment:
    """Sidecars prefill0/decode0, a prefill and a decode vLLM, the proxy: start(), then stop() always."""

    def __init__(self, python: str, model_dir: str, kind: str, dtype: str, workdir: str,
                 load_mode: str = "async", prefill_extra=None, decode_extra=None, sidecar_args=(),
                 failure_policy: str = "recompute", load_timeout_s: float = 30.0,
                 sidecar_module: str = "ciuicflow.kvflow.server"):
        self.workdir = workdir
        pl, dl = free_port(), free_port()
        # fixed API ports: a sidecar restarted (tests) is found again by its vLLM server's connector
        self.sc_p = SidecarProcess("prefill0", f"127.0.0.1:{pl}", {"decode0": f"127.0.0.1:{dl}"},
                                   os.path.join(workdir, "sidecar-prefill0.log"), args=sidecar_args,
                                   api=f"127.0.0.1:{free_port()}", module=sidecar_module)
        self.sc_d = SidecarProcess("decode0", f"127.0.0.1:{dl}", {"prefill0": f"127.0.0.1:{pl}"},
                                   os.path.join(workdir, "sidecar-decode0.log"), args=sidecar_args,
                                   api=f"127.0.0.1:{free_port()}", module=sidecar_module)
        self.args = (python, model_dir, kind, dtype, load_mode, dict(prefill_extra or {}), dict(decode_extra or {}),
                     failure_policy, load_timeout_s)
        self.prefill = self.decode = self.proxy = None

    def start(self, timeout: float = 600.0, log=print) -> "Deployment":
        python, model_dir, kind, dtype, load_mode, p_extra, d_extra, policy, load_timeout = self.args
        for sc in (self.sc_p, self.sc_d):
            sc.start()
        for sc in (self.sc_p, self.sc_d):
            sc.wait_ready(60)
        log(f"[vllm-demo] sidecars ready: prefill0 api={self.sc_p.api}, decode0 api={self.sc_d.api}")
        self.prefill = VllmServer("prefill", python, model_dir, kind, os.path.join(self.workdir, "vllm-prefill.log"),
                                  kv_transfer_config("kv_producer", self.sc_p.api, peer="decode0", name="prefill0",
                                                     **p_extra), dtype=dtype, failure_policy=policy)
        self.decode = VllmServer("decode", python, model_dir, kind, os.path.join(self.workdir, "vllm-decode.log"),
                                 kv_transfer_config("kv_consumer", self.sc_d.api, name="decode0", load_mode=load_mode,
                                                    load_timeout_s=load_timeout, **d_extra),
                                 dtype=dtype, failure_policy=policy)
        t0 = time.monotonic()
        for s in (self.prefill, self.decode):
            s.start()
        for s in (self.prefill, self.decode):
            s.wait_ready(timeout)
        log(f"[vllm-demo] vLLM servers healthy after {time.monotonic() - t0:.0f}s: prefill {self.prefill.url}, "
            f"decode {self.decode.url}")
        from .proxy import serve
        self.proxy = serve([self.prefill.url], [(self.decode.url, "decode0")], timeout=timeout)
        return self

    @property
    def proxy_url(self) -> str:
        return "http://%s:%d" % self.proxy.server_address[:2]

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.shutdown()
        for s in (self.prefill, self.decode):
            if s is not None:
                s.stop()
        for sc in (self.sc_p, self.sc_d):
            sc.stop()

    def connector_events(self):
        """(request ids the decode connector loaded, ids whose load failed), from its log."""
        text = self.decode.log(None)
        return LOADED_RE.findall(text), FAILED_RE.findall(text)


def received(api: str) -> int:
    """Transfers the sidecar at ``api`` has received complete so far."""
    from ciuicflow.kvflow import Client
    with Client(api) as c:
        return int(c.stats().get("store", {}).get("completed", 0))


def run_demo(args, log=print) -> dict:
    python = args.python or sys.executable
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"
    if subprocess.run([python, "-c", probe], capture_output=True, env=child_env()).returncode != 0:
        raise RuntimeError(f"{python} cannot import vllm: run `bash scripts/vllm_demo.sh` (it sets up vLLM's "
                           "environment) or pass --python")
    workdir = args.workdir or tempfile.mkdtemp(prefix="ciuicflow-vllm-demo-")
    os.makedirs(workdir, exist_ok=True)
    models_dir = args.models_dir or os.path.join(os.path.expanduser("~"), ".cache", "ciuicflow", "vllm-models")
    t_start = time.monotonic()
    model_dir = build_model(python, args.model, args.dtype, models_dir)
    log(f"[vllm-demo] model {args.model} ({args.dtype}) in {model_dir}; logs in {workdir}")
    prompts = make_prompts(args.prompts, BLOCK_SIZE[args.model])
    dep = Deployment(python, model_dir, args.model, args.dtype, workdir, args.load_mode)
    result = {"model": args.model, "dtype": args.dtype, "load_mode": args.load_mode, "workdir": workdir,
              "prompt_lengths": [len(p) for p in prompts], "ok": False}
    try:
        dep.start(args.timeout, log)
        before = received(dep.sc_d.api)
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:        # all at once: several requests per step
            disagg = list(pool.map(lambda p: complete(dep.proxy_url, p, args.new_tokens, args.timeout), prompts))
        t_disagg = time.monotonic() - t0
        transfers = received(dep.sc_d.api) - before
        t0 = time.monotonic()
        reference = [complete(dep.decode.url, p, args.new_tokens, args.timeout) for p in prompts]
        t_ref = time.monotonic() - t0
        loaded, failed = dep.connector_events()
        rows = []
        for i, (p, d, r) in enumerate(zip(prompts, disagg, reference)):
            same = d["tokens"] == r["tokens"] and len(d["tokens"]) == args.new_tokens
            rows.append({"prompt_len": len(p), "disaggregated": d["tokens"], "single_instance": r["tokens"],
                         "equal": same, "prefill_failed": d["headers"].get("x-ciuic-prefill") == "failed"})
            log(f"[vllm-demo] prompt {i} ({len(p):3d} tokens): {'equal' if same else 'DIFFERENT'}  "
                f"disaggregated {d['tokens']}  single instance {r['tokens']}")
        result.update(rows=rows, transfers_received=transfers, loads_logged=len(loaded), load_failures_logged=len(failed),
                      disaggregated_s=round(t_disagg, 3), single_instance_s=round(t_ref, 3),
                      total_s=round(time.monotonic() - t_start, 1))
        problems = []
        if not all(r["equal"] for r in rows):
            problems.append(f"{sum(not r['equal'] for r in rows)} prompt(s) decoded differently")
        if any(r["prefill_failed"] for r in rows):
            problems.append("the proxy's prefill failed for some prompts")
        if transfers != len(prompts):
            problems.append(f"the decode sidecar received {transfers} transfers for {len(prompts)} requests")
        # layerwise loads whole blocks of prompt - 1 tokens: a prompt of at most one block is computed
        block = BLOCK_SIZE[args.model]
        expect = sum(1 for p in prompts if args.load_mode == "async" or (len(p) - 1) // block > 0)
        result["loads_expected"] = expect
        if len(loaded) != expect or failed:
            problems.append(f"the decode connector loaded {len(loaded)} of {expect} requests' KV "
                            f"({len(failed)} failed loads)")
        result["problems"] = problems
        result["ok"] = not problems
        return result
    finally:
        dep.stop()


def run(args) -> int:
    try:
        result = run_demo(args)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"[vllm-demo] FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if result["ok"]:
        print(f"[vllm-demo] OK: {len(result['rows'])} prompts, decode tokens equal to a single instance's, "
              f"{result['loads_logged']} KV loads through the sidecars ({result['total_s']}s in all)")
        return 0
    print(f"[vllm-demo] FAILED: {'; '.join(result['problems'])} (logs in {result['workdir']})", file=sys.stderr)
    return 1
