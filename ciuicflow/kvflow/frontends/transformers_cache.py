"""transformers ``Cache`` objects <-> KV-flow transfers: a cache's layers as ordered parts, sent layer by
layer while prefill runs (``LayerStreamer``) or whole (``send_cache``), and rebuilt as a DynamicCache on the
decode side (``recv_cache``). The transfer's format: ``format.py``.

    with client.open("decode0", key, priority="high") as stream:
        with LayerStreamer(model, cache, stream) as streamer:       # each layer goes when it has run
            logits = model(input_ids, cache=cache, use_cache=True).logits
        streamer.finish(meta={"first_token": int(logits[0, -1].argmax())})
    # decode side
    received = recv_cache(client, key, timeout_s=30, config=model.config)
    received.cache, received.meta, received.first_layer_s
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .format import (FORMAT, HEADER_NAME, LAYOUTS, META_NAME, CacheFormatError, ReceivedCache, encode_json,
                     receive_layers)

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")


def cache_layers(cache) -> List[Tuple[Any, Any]]:
    """[(keys, values)] per layer of a transformers cache, whatever its version:
    ``cache.layers[i].keys/.values`` (>= 4.56), ``cache.key_cache/value_cache`` (older DynamicCache),
    or the legacy tuple of (keys, values) tuples."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for i, layer in enumerate(layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or not getattr(layer, "is_initialized", True):
                raise CacheFormatError(f"cache layer {i} holds nothing (was the model run with this cache?)")
            out.append((keys, values))
        return out
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) >= 2 for x in cache):
        return [(x[0], x[1]) for x in cache]
    raise CacheFormatError(f"cannot read layers from a {type(cache).__name__}: expected a transformers Cache "
                           "(DynamicCache) or a tuple of (keys, values) per layer")


def layer_kv(cache, index: int) -> Tuple[Any, Any]:
    """(keys, values) of one layer of a transformers cache (any version, see ``cache_layers``)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if index >= len(layers) or getattr(layers[index], "keys", None) is None:
            raise CacheFormatError(f"cache has no data for layer {index}")
        return layers[index].keys, layers[index].values
    if hasattr(cache, "key_cache"):
        if index >= len(cache.key_cache):
            raise CacheFormatError(f"cache has no data for layer {index}")
        return cache.key_cache[index], cache.value_cache[index]
    return cache_layers(cache)[index]


def _cfg(config, name, default=None):
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def detect_layout(keys, values, config=None) -> str:
    """"mla_latent" or "per_head" for one layer's cached keys/values of an attention model.

    With a config the shapes are checked against it (a DeepSeek config names kv_lora_rank and
    qk_rope_head_dim); without one, a single "head" whose values are narrower than its keys is taken
    for MLA latents.
    """
    if keys.dim() != 4 or values.dim() != 4:
        raise CacheFormatError(f"expected 4-D cached keys/values [B, H, S, D], got {tuple(keys.shape)} and "
                               f"{tuple(values.shape)}")
    if keys.shape[0] != values.shape[0] or keys.shape[2] != values.shape[2]:
        raise CacheFormatError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree on batch "
                               "or sequence length")
    kv_lora_rank = _cfg(config, "kv_lora_rank")
    if kv_lora_rank:
        rope = _cfg(config, "qk_rope_head_dim")
        nope = _cfg(config, "qk_nope_head_dim")
        v_dim = _cfg(config, "v_head_dim")
        heads = _cfg(config, "num_attention_heads")
        if keys.shape[1] == 1 and keys.shape[3] == kv_lora_rank and values.shape[1] == 1 and values.shape[3] == rope:
            return "mla_latent"
        # Older transformers expand the latents per head; with flash attention values may be padded to the
        # key width before they are cached.
        if keys.shape[1] == heads and keys.shape[3] == nope + rope and values.shape[1] == heads \
                and values.shape[3] in (v_dim, nope + rope):
            return "per_head"
        raise CacheFormatError(
            f"cached keys {tuple(keys.shape)} / values {tuple(values.shape)} match neither MLA latents "
            f"[B, 1, S, {kv_lora_rank}] / [B, 1, S, {rope}] nor per-head keys/values "
            f"[B, {heads}, S, {nope + rope}] / [B, {heads}, S, {v_dim}] of this config")
    if keys.shape[1] == 1 and values.shape[1] == 1 and values.shape[3] < keys.shape[3]:
        return "mla_latent"
    return "per_head"


def cache_header(layers: Sequence[Tuple[Any, Any]], config=None, layout: Optional[str] = None,
                 num_layers: Optional[int] = None) -> dict:
    """The JSON header of a cache transfer, from (at least) the first layer's keys/values."""
    if not layers:
        raise CacheFormatError("a cache with no layers")
    keys, values = layers[0]
    layout = layout or detect_layout(keys, values, config)
    if layout not in LAYOUTS:
        raise CacheFormatError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return {
        "format": FORMAT,
        "layout": layout,
        "model_type": _cfg(config, "model_type"),
        "num_layers": int(num_layers if num_layers is not None else len(layers)),
        "names": ["keys", "values"],
        "batch": int(keys.shape[0]),
        "seq_len": int(keys.shape[2]),
        "dtype": str(keys.dtype).removeprefix("torch."),
    }


def send_cache(client, dest: str, key: str, cache, config=None, meta: Optional[dict] = None,
               priority: str = "normal", deadline_s: Optional[float] = None, **kwargs):
    """Send a whole cache (e.g. after prefill); returns the SendHandle. For layer-by-layer sending while
    prefill runs use ``LayerStreamer``."""
    layers = cache_layers(cache)
    header = cache_header(layers, config)
    with client.open(dest, key, priority=priority, deadline_s=deadline_s, **kwargs) as stream:
        stream.append(encode_json(header), name=HEADER_NAME)
        for i, (keys, values) in enumerate(layers):
            stream.append(keys, name=f"layer.{i}.keys")
            stream.append(values, name=f"layer.{i}.values")
        if meta is not None:
            stream.append(encode_json(meta), name=META_NAME)
    return stream.handle


# ---------------------------------------------------------------------- layer-wise streaming during prefill
def decoder_layers(model) -> list:
    """The decoder layers of a transformers causal LM (``model.model.layers``) or base model (``model.layers``)."""
    for owner in (getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if layers is not None and len(layers) > 0:
            return list(layers)
    raise CacheFormatError(f"cannot find the decoder layers of a {type(model).__name__} "
                           "(looked for .model.layers and .layers)")


class LayerStreamer:
    """Hands each decoder layer's cache to an open transfer (``Client.open(...)``) as soon as that layer has
    run, through forward hooks, so the transfer overlaps the rest of prefill.

    Covers one forward pass (for chunked prefill, enter it around the last chunk: each layer's whole
    cache is sent). ``finish(meta)`` appends the optional meta part and checks every layer went out; it
    does not close the stream. ``layer_times[i]``: time.monotonic() when layer i was handed over.
    """

    def __init__(self, model, cache, stream, config=None, layout: Optional[str] = None):
        self.model = model
        self.cache = cache
        self.stream = stream
        self.config = config if config is not None else getattr(model, "config", None)
        self.layout = layout
        self.layers = decoder_layers(model)
        self.num_layers = len(self.layers)
        self.header: Optional[dict] = None
        self.layer_times: List[Optional[float]] = [None] * self.num_layers
        self.bytes_sent = 0
        self._handles = []
        self._finished = False

    def __enter__(self) -> "LayerStreamer":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, kwargs, output):
            self._send_layer(index, kwargs)
        return hook

    def _cache_from(self, kwargs):
        if self.cache is not None:
            return self.cache
        for name in ("cache", "past_key_values", "past_key_value"):
            if kwargs.get(name) is not None:
                return kwargs[name]
        raise CacheFormatError("no cache given to LayerStreamer and none passed to the decoder layer")

    def _send_layer(self, index: int, kwargs) -> None:
        if self.layer_times[index] is not None:
            raise CacheFormatError(f"decoder layer {index} ran twice under one LayerStreamer "
                                   "(it covers one forward pass; for chunked prefill use it on the last chunk)")
        cache = self._cache_from(kwargs)
        attn = getattr(self.layers[index], "self_attn", None)
        cache_index = getattr(attn, "layer_idx", index)
        keys, values = layer_kv(cache, cache_index)
        if self.header is None:
            if index != 0:
                raise CacheFormatError(f"decoder layer {index} ran before layer 0")
            self.header = cache_header([(keys, values)], self.config, self.layout, num_layers=self.num_layers)
            self.stream.append(encode_json(self.header), name=HEADER_NAME)
        elif int(keys.shape[2]) != self.header["seq_len"]:
            raise CacheFormatError(f"layer {index} caches {keys.shape[2]} positions, layer 0 cached "
                                   f"{self.header['seq_len']}")
        # append() copies the tensor into gRPC messages before it returns, so the cache may change later.
        self.stream.append(keys, name=f"layer.{index}.keys")
        self.stream.append(values, name=f"layer.{index}.values")
        self.bytes_sent += keys.numel() * keys.element_size() + values.numel() * values.element_size()
        self.layer_times[index] = time.monotonic()

    def finish(self, meta: Optional[dict] = None) -> None:
        """Append the meta part (if any); raises if some layer was never sent."""
        if self._finished:
            return
        self._finished = True
        missing = [i for i, t in enumerate(self.layer_times) if t is None]
        if missing:
            raise CacheFormatError(f"layers {missing} never ran under the LayerStreamer")
        if meta is not None:
            self.stream.append(encode_json(meta), name=META_NAME)


# ---------------------------------------------------------------------- receiving
def build_dynamic_cache(layers: Sequence[Sequence[Any]], config=None):
    """A transformers DynamicCache holding these (keys, values) per layer (any transformers version)."""
    from transformers import DynamicCache
    pairs = [(t[0], t[1]) for t in layers]
    try:
        return DynamicCache(ddp_cache_data=pairs, config=config)
    except TypeError:
        pass
    try:
        return DynamicCache(pairs)
    except TypeError:
        return DynamicCache.from_legacy_cache(tuple(pairs))


def check_layout(header: dict, config, local_layout: Optional[str] = None) -> None:
    """Raise CacheFormatError if a received header does not fit this side's model."""
    if header["layout"] not in ("mla_latent", "per_head"):
        raise CacheFormatError(f"a {header['layout']!r} transfer is not a transformers cache "
                               "(use receive_blocks / receive_layers)")
    n = _cfg(config, "num_hidden_layers")
    if n is not None and header["num_layers"] != n:
        raise CacheFormatError(f"the sender's cache has {header['num_layers']} layers, this model has {n}")
    mt = _cfg(config, "model_type")
    if mt and header.get("model_type") and header["model_type"] != mt:
        raise CacheFormatError(f"the sender's cache is from a {header['model_type']!r} model, this one is {mt!r}")
    if local_layout and header["layout"] != local_layout:
        raise CacheFormatError(
            f"the sender cached {header['layout']} keys/values, this transformers caches {local_layout}: "
            "prefill and decode must run transformers versions with the same DeepSeek cache layout")


def recv_cache(client, key: str, timeout_s: Optional[float] = None, config=None, device=None,
               on_layer=None, local_layout: Optional[str] = None) -> ReceivedCache:
    """Receive a cache sent by ``LayerStreamer``/``send_cache`` and rebuild a DynamicCache (``.cache``).

    The header is checked against ``config`` (layer count, model type) and, if given or detectable,
    against the layout this side's transformers caches (``local_cache_layout``)."""
    received = receive_layers(client, key, timeout_s, device, on_layer)
    if local_layout is None and _cfg(config, "model_type") in MLA_MODEL_TYPES:
        local_layout = local_cache_layout(_cfg(config, "model_type"))
    check_layout(received.header, config, local_layout)
    for layer in received.layers:
        detected = detect_layout(layer.tensors[0], layer.tensors[1], config)
        if detected != received.header["layout"]:
            raise CacheFormatError(f"layer {layer.index} holds {detected} tensors, header says "
                                   f"{received.header['layout']}")
    received.cache = build_dynamic_cache([layer.tensors for layer in received.layers], config)
    return received


_LOCAL_LAYOUT: Dict[str, str] = {}


def local_cache_layout(model_type: str = "deepseek_v3") -> str:
    """The layout this process's transformers caches for ``model_type``: runs a one-token forward of a
    throwaway 1-layer model of minimal size (milliseconds) and looks at what it cached."""
    if model_type in _LOCAL_LAYOUT:
        return _LOCAL_LAYOUT[model_type]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, vocab_size=16, hidden_size=16, intermediate_size=16,
                               moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
                               topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8,
                               q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6,
                               max_position_embeddings=8)
    rng = torch.get_rng_state()
    try:
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            out = model(torch.zeros(1, 1, dtype=torch.long), use_cache=True)
    finally:
        torch.set_rng_state(rng)    # the probe must not shift the caller's random stream
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    keys, values = cache_layers(cache)[0]
    _LOCAL_LAYOUT[model_type] = detect_layout(keys, values, cfg)
    return _LOCAL_LAYOUT[model_type]
