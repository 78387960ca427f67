"""The kv-demo's prefill and decode processes (``python -m ciuicflow.kvflow.demo prefill|decode``)."""
from __future__ import annotations

import argparse
import json
import os
import time

from .model import build_model, greedy_decode, make_prompts, model_fingerprint, transfer_key


def prefill_worker(spec: dict, api: str, dest: str) -> dict:
    import torch
    from transformers import DynamicCache
    from .. import Client
    from ..frontends import LayerStreamer, cache_layers, fingerprint

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
    from ..frontends import decoder_layers
    for layer in decoder_layers(model):
        _SLOW_HOOKS.append(layer.register_forward_hook(lambda *a, **k: time.sleep(delay_s)))


def _remove_slow_layers(model) -> None:
    while _SLOW_HOOKS:
        _SLOW_HOOKS.pop().remove()


def decode_worker(spec: dict, api: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from .. import Client
    from ..frontends import fingerprint, local_cache_layout, recv_cache

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
