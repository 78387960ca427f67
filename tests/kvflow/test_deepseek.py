"""DeepSeek-V3 KV-cache sync through the KV-flow sidecar: cache.py in isolation (layout detection, round trip
of a DynamicCache, paged blocks, layer-wise hand-over), over real sidecars, and the kv-demo end to end
(separate prefill and decode processes must reproduce the tokens of decoding in one process)."""
import argparse
import os
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="kv extra (transformers) not installed")

from ciuicflow.kvflow import Part  # noqa: E402
from ciuicflow.kvflow import frontends as kc  # noqa: E402
from ciuicflow.kvflow import demo  # noqa: E402
from ciuicflow.kvflow.client.payload import decode_part, encode_part  # noqa: E402

TINY = dict(demo.SIZES["tiny"], num_hidden_layers=3)


@pytest.fixture(scope="module")
def tiny():
    model, config = demo.build_model({"config": TINY, "seed": 0, "dtype": "float32", "threads": 1})
    return model, config


def prefill(model, config, prompt):
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
    return cache, int(out.logits[0, -1].argmax())


# ---------------------------------------------------------------------- an in-memory stand-in for Client
class MemoryStream:
    """Client.open() without a sidecar: parts go through the client's own wire codec."""

    def __init__(self, store, key, log):
        self.store, self.key, self.log, self.parts = store, key, log, []

    def append(self, value, name=""):
        info, mv = encode_part(len(self.parts), value, name)
        self.parts.append(Part(info.index, decode_part(info, bytearray(mv)), name, info.nbytes, info.is_tensor))
        self.log.append((name, time.monotonic()))
        return info.index

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.store[self.key] = self.parts
        self.handle = None


class MemoryRecv:
    def __init__(self, parts):
        self._it = iter(parts)

    def __iter__(self):
        return self._it

    def cancel(self):
        pass


class MemoryClient:
    def __init__(self):
        self.store, self.log = {}, []

    def open(self, dest, key, priority="normal", deadline_s=None, **kwargs):
        return MemoryStream(self.store, key, self.log)

    def recv_stream(self, key, timeout_s=None):
        return MemoryRecv(self.store.pop(key))


# ---------------------------------------------------------------------- layout detection
def test_layout_of_this_transformers_is_mla_latents(tiny):
    model, config = tiny
    cache, _ = prefill(model, config, [1, 2, 3, 4, 5])
    keys, values = kc.layer_kv(cache, 0)
    assert tuple(keys.shape) == (1, 1, 5, config.kv_lora_rank)
    assert tuple(values.shape) == (1, 1, 5, config.qk_rope_head_dim)
    assert kc.detect_layout(keys, values, config) == "mla_latent"
    assert kc.detect_layout(keys, values) == "mla_latent"
    assert kc.local_cache_layout("deepseek_v3") == "mla_latent"


def test_layout_per_head_and_bad_shapes(tiny):
    _, config = tiny
    h, qk = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    keys, values = torch.zeros(2, h, 7, qk), torch.zeros(2, h, 7, config.v_head_dim)
    assert kc.detect_layout(keys, values, config) == "per_head"           # older transformers
    assert kc.detect_layout(keys, torch.zeros(2, h, 7, qk), config) == "per_head"   # values padded (flash)
    assert kc.detect_layout(torch.zeros(1, 4, 3, 16), torch.zeros(1, 4, 3, 16)) == "per_head"
    with pytest.raises(kc.CacheFormatError, match="match neither"):
        kc.detect_layout(torch.zeros(1, 1, 5, 99), torch.zeros(1, 1, 5, config.qk_rope_head_dim), config)
    with pytest.raises(kc.CacheFormatError, match="disagree"):
        kc.detect_layout(torch.zeros(1, 1, 5, 32), torch.zeros(1, 1, 6, 8))
    with pytest.raises(kc.CacheFormatError, match="4-D"):
        kc.detect_layout(torch.zeros(5, 32), torch.zeros(5, 8))


def test_cache_layers_reads_every_cache_api(tiny):
    model, config = tiny
    cache, _ = prefill(model, config, [3, 1, 4])
    layers = kc.cache_layers(cache)
    assert len(layers) == config.num_hidden_layers

    class OldDynamicCache:       # transformers < 4.56: key_cache / value_cache lists
        key_cache = [k for k, _ in layers]
        value_cache = [v for _, v in layers]

    legacy = tuple((k, v) for k, v in layers)
    for source in (OldDynamicCache(), legacy):
        got = kc.cache_layers(source)
        assert all(a is c and b is d for (a, b), (c, d) in zip(got, layers))
    assert kc.layer_kv(OldDynamicCache(), 2)[0] is layers[2][0]
    with pytest.raises(kc.CacheFormatError, match="cannot read layers"):
        kc.cache_layers(object())
    with pytest.raises(kc.CacheFormatError, match="holds nothing"):
        kc.cache_layers(transformers.DynamicCache(config=config))


# ---------------------------------------------------------------------- round trips (wire codec, no sidecar)
def test_dynamic_cache_round_trip_decodes_the_same_tokens(tiny):
    model, config = tiny
    prompt = [7, 8, 9, 10, 11, 12]
    cache, first = prefill(model, config, prompt)
    client = MemoryClient()
    kc.send_cache(client, "decode0", "k1", cache, config, meta={"first_token": first})
    got = kc.recv_cache(client, "k1", config=config)
    assert got.header["layout"] == "mla_latent" and got.header["seq_len"] == len(prompt)
    assert got.meta == {"first_token": first}
    assert got.cache.get_seq_length() == len(prompt)
    assert kc.fingerprint(got.tensors) == kc.fingerprint(kc.cache_layers(cache))
    remote = demo.greedy_decode(model, got.cache, first, 5)
    assert remote == demo.reference_tokens(model, config, prompt, 5)


def test_recv_cache_refuses_a_cache_of_another_model(tiny):
    model, config = tiny
    cache, _ = prefill(model, config, [1, 2])
    client = MemoryClient()
    kc.send_cache(client, "d", "k", cache, config)
    other = transformers.DeepseekV3Config(**dict(TINY, num_hidden_layers=5))
    with pytest.raises(kc.CacheFormatError, match="3 layers, this model has 5"):
        kc.recv_cache(client, "k", config=other)
    kc.send_cache(client, "d", "k2", cache, config)
    with pytest.raises(kc.CacheFormatError, match="this transformers caches per_head"):
        kc.recv_cache(client, "k2", config=config, local_layout="per_head")
    client.store["k3"] = [Part(0, b"not a cache", "something", 11, False)]
    with pytest.raises(kc.CacheFormatError, match="not a KV cache"):
        kc.recv_cache(client, "k3", config=config)


def test_layer_streamer_hands_each_layer_over_before_the_next_runs(tiny):
    model, config = tiny
    client = MemoryClient()
    started = {}

    def note_start(index):
        def pre_hook(module, args):
            started.setdefault(index, time.monotonic())     # returns None: the inputs stay as they are
        return pre_hook

    hooks = [layer.register_forward_pre_hook(note_start(i)) for i, layer in enumerate(kc.decoder_layers(model))]
    try:
        cache = transformers.DynamicCache(config=config)
        with client.open("d", "stream") as stream:
            with kc.LayerStreamer(model, cache, stream) as streamer:
                with torch.no_grad():
                    out = model(torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True)
                streamer.finish(meta={"first_token": int(out.logits[0, -1].argmax())})
    finally:
        for h in hooks:
            h.remove()
    names = [n for n, _ in client.log]
    assert names == ["kvcache.header"] + [f"layer.{i}.{n}" for i in range(3) for n in ("keys", "values")] \
        + ["kvcache.meta"]
    sent = {n: t for n, t in client.log}
    for i in range(2):
        assert sent[f"layer.{i}.values"] <= started[i + 1], "layer handed over only after the next layer started"
    got = kc.recv_cache(client, "stream", config=config)
    assert kc.fingerprint(got.tensors) == kc.fingerprint(kc.cache_layers(cache))
    # a second forward under the same streamer is refused (it covers one prefill pass)
    with kc.LayerStreamer(model, cache, client.open("d", "x")) as streamer:
        with torch.no_grad():
            model(torch.tensor([[1]]), cache=cache, use_cache=True)
        with pytest.raises(kc.CacheFormatError, match="ran twice"):
            with torch.no_grad():
                model(torch.tensor([[2]]), cache=cache, use_cache=True)


def test_paged_blocks_round_trip_into_other_block_ids():
    g = torch.Generator().manual_seed(0)
    layers, num_blocks, block_size = 3, 10, 4
    src = [torch.randn(num_blocks, block_size, 576, generator=g).to(torch.bfloat16) for _ in range(layers)]
    dst = [torch.zeros(num_blocks, block_size, 576, dtype=torch.bfloat16) for _ in range(layers)]
    client = MemoryClient()
    kc.send_blocks(client, "d", "blocks", src, [7, 2, 5], num_tokens=11)
    got = kc.recv_blocks(client, "blocks", dst, [0, 1, 9])
    assert got.header["layout"] == "paged" and got.header["block_size"] == block_size
    assert got.header["num_tokens"] == 11
    for s, d in zip(src, dst):
        assert torch.equal(d[[0, 1, 9]], s[[7, 2, 5]])
        assert not d[[2, 3, 4, 5, 6, 7, 8]].any()
    with pytest.raises(kc.CacheFormatError, match="block ids must be in"):
        kc.gather_blocks(src, [3, 10])
    kc.send_blocks(client, "d", "b2", src, [1, 2])
    with pytest.raises(kc.CacheFormatError, match="do not fit"):
        kc.recv_blocks(client, "b2", dst, [0, 1, 2])


# ---------------------------------------------------------------------- over real sidecars
@pytest.fixture(scope="module")
def pair(module_sidecars):
    return module_sidecars.pair(a_args=["--chunk-size", "64KiB"])


def test_cache_and_blocks_over_real_sidecars(pair, tiny):
    a, b = pair
    model, config = tiny
    prompt = list(range(40, 80))
    cache, first = prefill(model, config, prompt)
    ca, cb = a.client(), b.client()
    ca_fifo = a.client(flow=False)
    kc.send_cache(ca, "b", "cache-flow", cache, config, meta={"first_token": first}, priority="high").wait(60)
    kc.send_cache(ca_fifo, "b", "cache-fifo", cache, config, meta={"first_token": first}).wait(60)
    for key in ("cache-flow", "cache-fifo"):
        got = kc.recv_cache(cb, key, timeout_s=30, config=config)
        assert kc.fingerprint(got.tensors) == kc.fingerprint(kc.cache_layers(cache))
        assert demo.greedy_decode(model, got.cache, got.meta["first_token"], 4) == \
            demo.reference_tokens(model, config, prompt, 4)
    blocks = [torch.randn(64, 16, 576).to(torch.bfloat16) for _ in range(4)]   # 4 x 1.2 MB: several chunks
    kc.send_blocks(ca, "b", "blocks", blocks, list(range(0, 64, 2)), priority="low").wait(60)
    dst = [torch.zeros_like(x) for x in blocks]
    kc.recv_blocks(cb, "blocks", dst, list(range(32)), timeout_s=30)
    for s, d in zip(blocks, dst):
        assert torch.equal(d[:32], s[0::2])


# ---------------------------------------------------------------------- end to end: the kv-demo
def test_kv_demo_disaggregated_decode_matches_one_process(tmp_path):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--layers", "3", "--prompts", "3", "--prompt-len", "20", "--new-tokens", "6",
                              "--layer-delay-ms", "200", "--timeout", "300", "--workdir", str(tmp_path)])
    result = demo.run_demo(args, log=print)
    print(demo.report(result))
    assert result["same_model_everywhere"]
    assert result["local_layout"] == "mla_latent"
    assert len(result["prompts"]) == 3
    for row in result["prompts"]:
        assert row["tokens_match"], row
        assert row["cache_identical"], row
        assert row["layers"] == 3 and row["flow"]
        # layer-wise pipelining: with each layer made 200 ms slow, layer 0 must reach the decode process
        # while prefill is still running (a sender that waited for the whole cache could not do this)
        assert row["first_layer_before_prefill_end_s"] > 0, row
    assert result["ok"]
