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
import subprocess
import sys
import tempfile
import time

from ..sidecar.process import REPO_ROOT, SidecarProcess, child_env, free_port, log_tail
from .model import SIZES, build_model, make_prompts, model_config_kwargs, model_fingerprint, reference_tokens


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
                                   f"{log_tail(os.path.join(workdir, role + '.log'))}") from None
            if rc != 0 or not os.path.exists(out):
                raise RuntimeError(f"{role} process failed (exit code {rc}):\n"
                                   f"{log_tail(os.path.join(workdir, role + '.log'))}")
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


def report(result: dict) -> str:
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
    print(report(result), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["ok"] else 1
