"""``ciuicflow kv-demo``: disaggregated prefill and decode of a DeepSeek-V3-architecture model through two
KV-flow sidecars, checked token for token against decoding in one process.

Five OS processes on 127.0.0.1: sidecar ``prefill0``, sidecar ``decode0``, a prefill process (runs the prompt
through the model and hands each decoder layer's cache to its sidecar as soon as that layer has run), a decode
process (receives the cache layer by layer from its sidecar, rebuilds a DynamicCache and decodes greedily),
and this one, which starts them and decodes the same prompts in one process as the reference. The model is
a randomly initialised DeepseekV3 built from a config with a fixed seed: nothing is downloaded.

    ciuicflow kv-demo                                  # tiny model, 4 prompts
    ciuicflow kv-demo --size small --prompts 8 --new-tokens 16 --json out/kv_demo.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_RE = re.compile(r"sidecar '(?P<name>[^']+)' ready: api=(?P<api>\S+) listen=(?P<listen>\S+)")

# DeepseekV3Config arguments per --size. "base" has DeepSeek-V3's own attention widths (kv_lora_rank 512 +
# qk_rope_head_dim 64 = 576 cached values per token and layer); the rest are scaled down.
SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 max_position_embeddings=512),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                  max_position_embeddings=2048),
    "base": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=16,
                 num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                 kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 max_position_embeddings=4096),
}


# ---------------------------------------------------------------------- sidecar processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


class SidecarProcess:
    """One ``python -m ciuicflow.kvflow.server`` process. ``launch(argv, stdout=...)`` starts it (default:
    subprocess.Popen here; the benchmark passes SimCluster.popen to start it inside a network namespace)."""

    def __init__(self, name: str, listen: str, peers: Dict[str, str], log_path: str, args=(),
                 api: str = "127.0.0.1:0", launch: Optional[Callable] = None):
        self.name = name
        self.listen = listen
        self.peers = dict(peers)
        self.log_path = log_path
        self.args = [str(a) for a in args]
        self.api_arg = api
        self.api: Optional[str] = None          # the bound address, from the ready line
        self._launch = launch
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def argv(self) -> List[str]:
        cmd = [sys.executable, "-m", "ciuicflow.kvflow.server", "--name", self.name, "--api", self.api_arg,
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
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

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


# ---------------------------------------------------------------------- the model (every process builds the same)
def model_config_kwargs(size: str, layers: Optional[int] = None, config_file: Optional[str] = None) -> dict:
    if config_file:
        with open(config_file) as fh:
            kwargs = json.load(fh)
        for drop in ("architectures", "auto_map", "quantization_config", "transformers_version", "torch_dtype",
                     "dtype"):
            kwargs.pop(drop, None)
    else:
        if size not in SIZES:
            raise ValueError(f"--size must be one of {sorted(SIZES)}, got {size!r}")
        kwargs = dict(SIZES[size])
    if layers is not None:
        if layers < 1:
            raise ValueError("--layers must be at least 1")
        kwargs["num_hidden_layers"] = layers
        kwargs["first_k_dense_replace"] = min(kwargs.get("first_k_dense_replace", 1), layers)
    return kwargs


def build_model(spec: dict):
    """(model, config) from a spec: the same weights in every process (seeded random init)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.set_num_threads(int(spec.get("threads", 1)))
    config = DeepseekV3Config(**spec["config"])
    torch.manual_seed(int(spec["seed"]))
    model = DeepseekV3ForCausalLM(config)
    model = model.to(getattr(torch, spec["dtype"])).eval()
    return model, config


def model_fingerprint(model) -> str:
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().sum().double().numpy().tobytes())
        h.update(p.detach().reshape(-1)[:64].float().numpy().tobytes())
    return h.hexdigest()[:16]


def make_prompts(spec: dict) -> List[List[int]]:
    import random
    rng = random.Random(int(spec["seed"]) + 1)
    longest, vocab = int(spec["prompt_len"]), int(spec["config"]["vocab_size"])
    return [[rng.randrange(vocab) for _ in range(rng.randint(max(1, longest // 2), longest))]
            for _ in range(int(spec["prompts"]))]


def greedy_decode(model, cache, first_token: int, new_tokens: int) -> List[int]:
    """Greedy decoding from a filled cache: ``first_token`` (from prefill) then new_tokens - 1 more."""
    import torch
    tokens = [int(first_token)]
    with torch.no_grad():
        for _ in range(new_tokens - 1):
            out = model(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def reference_tokens(model, config, prompt: List[int], new_tokens: int) -> List[int]:
    """Prefill and decode in this one process: what the disaggregated pair must reproduce."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
    return greedy_decode(model, cache, int(out.logits[0, -1].argmax()), new_tokens)


def transfer_key(spec: dict, index: int) -> str:
    return f"{spec['run_id']}/prompt-{index}"


# ---------------------------------------------------------------------- worker processes
def prefill_worker(spec: dict, api: str, dest: str) -> dict:
    import torch
    from transformers import DynamicCache
    from . import Client
    from .frontends.transformers_cache import LayerStreamer, fingerprint, cache_layers

    model, config = build_model(spec)
    client = Client(api, flow=bool(spec["flow"]))
    client.wait_ready(30)
    _wait_for_file(spec["decode_ready_file"], spec["timeout_s"])   # as in serving: decode is up first
    results = []
    handles = []
    for i, prompt in enumerate(make_prompts(spec)):
        key = transfer_key(spec, i)
        cache = DynamicCache(config=config)
        started = time.monotonic()
        with client.open(dest, key, priority=spec["priority"], deadline_s=spec.get("deadline_s")) as stream:
            with LayerStreamer(model, cache, stream) as streamer:
                if spec.get("layer_delay_s"):
                    _slow_layers(model, float(spec["layer_delay_s"]))
                with torch.no_grad():
                    out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
                ended = time.monotonic()
                first_token = int(out.logits[0, -1].argmax())
                streamer.finish(meta={"prompt_index": i, "prompt_len": len(prompt), "first_token": first_token})
        handles.append(stream.handle)
        results.append({"index": i, "key": key, "prompt_len": len(prompt), "first_token": first_token,
                        "prefill_start": started, "prefill_end": ended, "layer_times": streamer.layer_times,
                        "cache_bytes": streamer.bytes_sent, "layout": streamer.header["layout"],
                        "fingerprint": fingerprint(cache_layers(cache))})
        _remove_slow_layers(model)
    for r, h in zip(results, handles):
        res = h.wait(spec["timeout_s"])
        r["delivered"] = time.monotonic()
        r["sent_bytes"] = res.bytes
        r["chunks"] = res.chunks
        r["flow"] = res.flow
    client.close()
    return {"role": "prefill", "model": model_fingerprint(model), "prompts": results}


def _wait_for_file(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s:g}s")
        time.sleep(0.02)


_SLOW_HOOKS: list = []


def _slow_layers(model, delay_s: float) -> None:
    """Test aid: make every decoder layer take ``delay_s`` longer (after its cache was handed over), as
    the layers of a big model do, so that the overlap of transfer and prefill is visible on a tiny one."""
    from .frontends.transformers_cache import decoder_layers
    for layer in decoder_layers(model):
        _SLOW_HOOKS.append(layer.register_forward_hook(lambda *a, **k: time.sleep(delay_s)))


def _remove_slow_layers(model) -> None:
    while _SLOW_HOOKS:
        _SLOW_HOOKS.pop().remove()


def decode_worker(spec: dict, api: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from . import Client
    from .frontends.transformers_cache import fingerprint, local_cache_layout, recv_cache

    model, config = build_model(spec)
    layout = local_cache_layout(config.model_type)
    client = Client(api)
    client.wait_ready(30)
    n = int(spec["prompts"])

    def receive(i):
        # Each cache is received (layer by layer) as soon as it comes, while earlier prompts decode.
        received = recv_cache(client, transfer_key(spec, i), timeout_s=spec["timeout_s"], config=config,
                              local_layout=layout)
        return received, time.monotonic()

    results = []
    with ThreadPoolExecutor(max_workers=min(n, 16), thread_name_prefix="recv") as pool:
        futures = [pool.submit(receive, i) for i in range(n)]
        with open(spec["decode_ready_file"], "w") as fh:
            fh.write("ready\n")
        for i, future in enumerate(futures):
            received, got = future.result()
            meta = received.meta or {}
            if meta.get("prompt_index") != i:
                raise RuntimeError(f"transfer {transfer_key(spec, i)!r} carries meta {meta}, expected prompt {i}")
            tokens = greedy_decode(model, received.cache, meta["first_token"], int(spec["new_tokens"]))
            results.append({"index": i, "key": transfer_key(spec, i), "tokens": tokens,
                            "seq_len": received.header["seq_len"], "layout": received.header["layout"],
                            "first_layer_at": received.first_layer_at, "last_layer_at": received.last_layer_at,
                            "received": got, "layers": len(received.layers), "bytes": received.nbytes(),
                            "fingerprint": fingerprint(received.tensors), "decoded": time.monotonic()})
    client.close()
    return {"role": "decode", "model": model_fingerprint(model), "local_layout": layout, "prompts": results}


def worker_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ciuicflow.kvflow.demo", description="kv-demo worker process")
    p.add_argument("role", choices=("prefill", "decode"))
    p.add_argument("--spec", required=True)
    p.add_argument("--api", required=True)
    p.add_argument("--dest", default="decode0")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with open(a.spec) as fh:
        spec = json.load(fh)
    result = prefill_worker(spec, a.api, a.dest) if a.role == "prefill" else decode_worker(spec, a.api)
    tmp = a.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh)
    os.replace(tmp, a.out)
    return 0


# ---------------------------------------------------------------------- the command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="tiny", choices=sorted(SIZES),
                   help="model size preset (default tiny; 'base' has DeepSeek-V3's attention widths)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--model-config", metavar="JSON", help="DeepseekV3Config arguments from a JSON file (e.g. a "
                   "config.json; weights are still random)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--prompt-len", type=int, default=24, help="longest prompt in tokens (lengths vary down to half)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to decode per prompt (default 8)")
    p.add_argument("--priority", default="high", choices=("high", "normal", "low"))
    p.add_argument("--no-flow", action="store_true", help="send without x-ciuic-flow: enabled (FIFO baseline)")
    p.add_argument("--chunk-size", default="256KiB", help="sidecar chunk size")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--layer-delay-ms", type=float, default=0.0,
                   help="make each prefill layer this much slower, as in a big model (shows the overlap)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole demo")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--workdir", metavar="DIR", help="keep logs and worker outputs here (default: a temp dir)")


def _spec_from_args(args, run_id: str) -> dict:
    for name in ("prompts", "prompt_len", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    return {"config": model_config_kwargs(args.size, args.layers, args.model_config), "seed": args.seed,
            "dtype": args.dtype, "prompts": args.prompts, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "priority": args.priority, "flow": not args.no_flow,
            "threads": args.threads, "timeout_s": float(args.timeout), "run_id": run_id,
            "layer_delay_s": args.layer_delay_ms / 1000.0, "deadline_s": None}


def _decode_ready_file(workdir: str) -> str:
    return os.path.join(workdir, "decode.ready")


def _start_worker(role: str, spec_path: str, api: str, workdir: str):
    out = os.path.join(workdir, f"{role}.json")
    log = open(os.path.join(workdir, f"{role}.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "ciuicflow.kvflow.demo", role, "--spec", spec_path,
                             "--api", api, "--dest", "decode0", "--out", out],
                            cwd=REPO_ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, out, log


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read()[-n:]
    except FileNotFoundError:
        return ""


def run_demo(args, log=print) -> dict:
    """Run the whole demo; returns the result (``result["ok"]``). Raises RuntimeError when a process fails."""
    run_id = f"kvdemo-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    spec = _spec_from_args(args, run_id)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ciuicflow-kvdemo-")
    os.makedirs(workdir, exist_ok=True)
    spec["decode_ready_file"] = _decode_ready_file(workdir)
    if os.path.exists(spec["decode_ready_file"]):
        os.remove(spec["decode_ready_file"])
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    started = time.monotonic()
    deadline = started + float(args.timeout)
    ports = {"prefill0": free_port(), "decode0": free_port()}
    listen = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    common = ["--chunk-size", str(args.chunk_size), "--log-level", "INFO"]
    sidecars = [
        SidecarProcess("prefill0", listen["prefill0"], {"decode0": listen["decode0"]},
                       os.path.join(workdir, "sidecar-prefill0.log"), common),
        SidecarProcess("decode0", listen["decode0"], {"prefill0": listen["prefill0"]},
                       os.path.join(workdir, "sidecar-decode0.log"), common),
    ]
    workers = []
    try:
        for sc in sidecars:
            sc.start()
        for sc in sidecars:
            sc.wait_ready(max(5.0, deadline - time.monotonic()))
        log(f"[kv-demo] sidecars ready: prefill0 api={sidecars[0].api} listen={listen['prefill0']}, "
            f"decode0 api={sidecars[1].api} listen={listen['decode0']}")
        workers.append(("decode",) + _start_worker("decode", spec_path, sidecars[1].api, workdir))
        workers.append(("prefill",) + _start_worker("prefill", spec_path, sidecars[0].api, workdir))
        log(f"[kv-demo] prefill process pid {workers[1][1].pid}, decode process pid {workers[0][1].pid}; "
            "decoding the same prompts in this process meanwhile (the reference)")
        import torch
        import transformers
        threads = torch.get_num_threads()
        try:
            model, config = build_model(spec)
            reference = [reference_tokens(model, config, p, spec["new_tokens"]) for p in make_prompts(spec)]
            ref_model = model_fingerprint(model)
        finally:
            torch.set_num_threads(threads)
        outputs = {}
        for role, proc, out, fh in workers:
            try:
                rc = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{role} process still running after {args.timeout:g}s:\n"
                                   f"{_tail(os.path.join(workdir, role + '.log'))}") from None
            if rc != 0 or not os.path.exists(out):
                raise RuntimeError(f"{role} process failed (exit code {rc}):\n"
                                   f"{_tail(os.path.join(workdir, role + '.log'))}")
            with open(out) as f:
                outputs[role] = json.load(f)
    finally:
        for _, proc, _, fh in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            fh.close()
        for sc in sidecars:
            sc.terminate()
        for sc in sidecars:
            sc.stop()
    return _compare(spec, outputs["prefill"], outputs["decode"], reference, ref_model,
                    transformers.__version__, time.monotonic() - started, workdir)


def _compare(spec, prefill, decode, reference, ref_model, tf_version, seconds, workdir) -> dict:
    rows = []
    for p, d, ref in zip(prefill["prompts"], decode["prompts"], reference):
        rows.append({
            "index": p["index"], "prompt_len": p["prompt_len"], "layout": d["layout"], "layers": d["layers"],
            "cache_bytes": d["bytes"], "tokens_remote": d["tokens"], "tokens_reference": ref,
            "tokens_match": d["tokens"] == ref, "cache_identical": p["fingerprint"] == d["fingerprint"],
            "prefill_s": p["prefill_end"] - p["prefill_start"],
            # > 0: the first layer reached the decode process before prefill finished (overlap)
            "first_layer_before_prefill_end_s": p["prefill_end"] - d["first_layer_at"],
            "first_layer_after_prefill_start_s": d["first_layer_at"] - p["prefill_start"],
            "all_layers_after_prefill_end_s": d["last_layer_at"] - p["prefill_end"],
            "layers_handed_before_prefill_end": sum(1 for t in p["layer_times"] if t <= p["prefill_end"]),
            "flow": p["flow"], "chunks": p["chunks"],
        })
    same_model = prefill["model"] == decode["model"] == ref_model
    ok = bool(rows) and same_model and all(r["tokens_match"] and r["cache_identical"] for r in rows) \
        and len(rows) == spec["prompts"]
    return {"ok": ok, "same_model_everywhere": same_model, "model_fingerprint": ref_model,
            "transformers": tf_version, "local_layout": decode["local_layout"], "config": spec["config"],
            "dtype": spec["dtype"], "seed": spec["seed"], "flow": spec["flow"], "priority": spec["priority"],
            "new_tokens": spec["new_tokens"], "seconds": seconds, "workdir": workdir, "prompts": rows}


def _report(result: dict) -> str:
    c = result["config"]
    lines = [
        f"kv-demo: DeepseekV3 ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLA kv_lora_rank "
        f"{c['kv_lora_rank']} + qk_rope_head_dim {c['qk_rope_head_dim']}, {result['dtype']}, seed {result['seed']}),"
        f" transformers {result['transformers']}, cache layout {result['local_layout']}, flow control "
        f"{'on (x-ciuic-flow: enabled)' if result['flow'] else 'off (FIFO)'}, priority {result['priority']}",
        "",
        "| prompt | tokens | cache bytes | chunks | prefill ms | 1st layer at decode, ms after prefill start "
        "| all layers, ms after prefill end | tokens (decode process) | same as one process | cache bit-identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in result["prompts"]:
        toks = " ".join(str(t) for t in r["tokens_remote"])
        lines.append(f"| {r['index']} | {r['prompt_len']} | {r['cache_bytes']:,} | {r['chunks']} | "
                     f"{r['prefill_s'] * 1e3:.1f} | {r['first_layer_after_prefill_start_s'] * 1e3:.1f} | "
                     f"{r['all_layers_after_prefill_end_s'] * 1e3:.1f} | {toks} | "
                     f"{'yes' if r['tokens_match'] else 'NO: ' + ' '.join(map(str, r['tokens_reference']))} | "
                     f"{'yes' if r['cache_identical'] else 'NO'} |")
    n = len(result["prompts"])
    good = sum(1 for r in result["prompts"] if r["tokens_match"] and r["cache_identical"])
    lines.append("")
    if not result["same_model_everywhere"]:
        lines.append("!!! the three processes built different models (seeded init differs): results meaningless")
    verdict = "OK" if result["ok"] else "FAILED"
    lines.append(f"RESULT: {verdict} - {good}/{n} prompts decoded from the transferred cache gave exactly the "
                 f"tokens of decoding in one process, with the cache bit-identical ({result['seconds']:.1f} s)")
    return "\n".join(lines)


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        result = run_demo(args, log=lambda m: print(m, flush=True))
    except (RuntimeError, ValueError) as exc:
        print(f"kv-demo: FAILED: {exc}", file=sys.stderr)
        return 1
    print(_report(result), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(worker_main())
