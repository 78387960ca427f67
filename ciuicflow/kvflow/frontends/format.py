"""The format of a KV-cache transfer, whatever produced the cache (``transformers_cache``, ``paged``), and
receiving one layer by layer. A cache transfer is a "tensors" transfer of the sidecar, parts in this order:

    part 0                  bytes, name "kvcache.header": JSON (format, layout, num_layers, names per layer, ...)
    parts 1 .. L*T          tensors, name "layer.{i}.{name}" (T tensors per layer, e.g. keys then values)
    last part (optional)    bytes, name "kvcache.meta": JSON known only once prefill ended (e.g. first token)

Layouts (``header["layout"]``):
    "mla_latent"  DeepSeek-V2/V3 multi-head latent attention as recent transformers caches it: per layer
                  keys = compressed KV [B, 1, S, kv_lora_rank], values = rotary key [B, 1, S, qk_rope_head_dim]
    "per_head"    ordinary per-head keys/values [B, H, S, D] (older transformers cache DeepSeek-V3 like this:
                  keys [B, H, S, qk_nope_head_dim + qk_rope_head_dim], values [B, H, S, v_head_dim])
    "paged"       an inference server's paged blocks: per layer one tensor [n, block_size, ...] gathered
                  from its block table
    "raw"         any list of tensors per layer
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

FORMAT = "ciuicflow.kvcache/1"
HEADER_NAME = "kvcache.header"
META_NAME = "kvcache.meta"
LAYOUTS = ("mla_latent", "per_head", "paged", "raw")
# A received header comes from the sending peer: what it may declare is bounded before anything is built
# from it (a header declaring 10^12 layers would otherwise be expanded into as many part names).
MAX_HEADER_BYTES = 1 << 20
MAX_LAYERS = 4096
MAX_NAMES = 64                  # tensors per layer
MAX_NAME_LEN = 256


class CacheFormatError(ValueError):
    """A cache (sent or received) that does not have the shape, layout or structure expected."""


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True).encode()


def part_names(header: dict) -> Iterator[str]:
    """The tensor parts' names, in order (generated as they are needed)."""
    return (f"layer.{i}.{n}" for i in range(header["num_layers"]) for n in header["names"])


def parse_header(key: str, raw) -> dict:
    """A received cache header, checked: format, layout, and a bounded number of layers and names."""
    if len(raw) > MAX_HEADER_BYTES:
        raise CacheFormatError(f"transfer {key!r}: cache header of {len(raw)} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = json.loads(bytes(raw))
    except ValueError as exc:
        raise CacheFormatError(f"transfer {key!r}: cache header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheFormatError(f"transfer {key!r}: unknown cache format "
                               f"{header.get('format') if isinstance(header, dict) else header!r}")
    layers, names = header.get("num_layers"), header.get("names")
    if type(layers) is not int or not 1 <= layers <= MAX_LAYERS:
        raise CacheFormatError(f"transfer {key!r}: num_layers must be 1..{MAX_LAYERS}, got {layers!r}")
    if (not isinstance(names, list) or not 1 <= len(names) <= MAX_NAMES
            or not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_LEN for n in names)):
        raise CacheFormatError(f"transfer {key!r}: names must be 1..{MAX_NAMES} strings of up to "
                               f"{MAX_NAME_LEN} characters")
    if header.get("layout") not in LAYOUTS:
        raise CacheFormatError(f"transfer {key!r}: unknown layout {header.get('layout')!r}")
    return header


def send_tensors(client, dest: str, key: str, layers: Sequence[Sequence[Any]], names: Sequence[str],
                 layout: str = "raw", extra: Optional[dict] = None, meta: Optional[dict] = None,
                 priority: str = "normal", deadline_s: Optional[float] = None, **kwargs):
    """Send any tensors grouped by layer (``layers[i]`` = one tensor per name); returns the SendHandle."""
    if layout not in LAYOUTS:
        raise CacheFormatError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not layers:
        raise CacheFormatError("nothing to send: no layers")
    for i, tensors in enumerate(layers):
        if len(tensors) != len(names):
            raise CacheFormatError(f"layer {i} has {len(tensors)} tensors, expected {len(names)} ({list(names)})")
    header = {"format": FORMAT, "layout": layout, "num_layers": len(layers), "names": list(names),
              "dtype": str(layers[0][0].dtype).removeprefix("torch."), **(extra or {})}
    with client.open(dest, key, priority=priority, deadline_s=deadline_s, **kwargs) as stream:
        stream.append(encode_json(header), name=HEADER_NAME)
        for i, tensors in enumerate(layers):
            for name, t in zip(names, tensors):
                stream.append(t, name=f"layer.{i}.{name}")
        if meta is not None:
            stream.append(encode_json(meta), name=META_NAME)
    return stream.handle


# ---------------------------------------------------------------------- receiving
@dataclass
class LayerKV:
    index: int
    tensors: List[Any]          # in header["names"] order (keys, values for a transformers cache)
    arrived: float              # time.monotonic() when its last tensor arrived


@dataclass
class ReceivedCache:
    header: dict
    layers: List[LayerKV]
    meta: Optional[dict]
    first_layer_at: float       # time.monotonic() when layer 0 was complete
    last_layer_at: float
    started: float              # when the receive call began
    cache: Any = None           # a DynamicCache (recv_cache) or None (raw/paged)

    @property
    def first_layer_s(self) -> float:
        return self.first_layer_at - self.started

    @property
    def tensors(self) -> List[List[Any]]:
        return [layer.tensors for layer in self.layers]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors)


class CacheReceiver:
    """Iterates a cache transfer layer by layer as the parts arrive: ``header`` is set first, then each
    ``LayerKV`` is yielded as soon as its tensors are complete; ``meta`` is set at the end."""

    def __init__(self, client, key: str, timeout_s: Optional[float] = None, source: Optional[str] = None):
        self.key = key
        self.started = time.monotonic()
        if source:
            self._stream = client.recv_stream(key, timeout_s, source=source)
        else:       # the call stand-in clients (tests) know
            self._stream = client.recv_stream(key, timeout_s)
        self.header: Optional[dict] = None
        self.meta: Optional[dict] = None

    def cancel(self) -> None:
        self._stream.cancel()

    def __iter__(self) -> Iterator[LayerKV]:
        parts = iter(self._stream)
        first = next(parts, None)
        if first is None or first.name != HEADER_NAME or first.is_tensor:
            self._stream.cancel()
            raise CacheFormatError(f"transfer {self.key!r} is not a KV cache: its first part is "
                                   f"{'missing' if first is None else repr(first.name)}, not {HEADER_NAME!r}")
        try:
            header = parse_header(self.key, first.value)
        except CacheFormatError:
            self._stream.cancel()
            raise
        self.header = header
        per_layer = len(header["names"])
        total = header["num_layers"] * per_layer
        pending: List[Any] = []
        for pos, name in enumerate(part_names(header)):
            part = next(parts, None)
            if part is None:
                raise CacheFormatError(f"transfer {self.key!r} ended after {pos} of {total} tensors")
            if not part.is_tensor or part.name != name:
                raise CacheFormatError(f"transfer {self.key!r}: part {part.index} is {part.name!r}, expected "
                                       f"tensor {name!r}")
            pending.append(part.value)
            if len(pending) == per_layer:
                yield LayerKV(pos // per_layer, pending, time.monotonic())
                pending = []
        rest = list(parts)
        if rest:
            if len(rest) != 1 or rest[0].name != META_NAME:
                raise CacheFormatError(f"transfer {self.key!r}: unexpected parts after the layers: "
                                       f"{[p.name for p in rest]}")
            self.meta = json.loads(bytes(rest[0].value))


def receive_layers(client, key: str, timeout_s: Optional[float] = None, device=None,
                   on_layer=None, source: Optional[str] = None) -> ReceivedCache:
    """Receive a cache transfer layer by layer (each layer moved to ``device`` as it lands, and passed to
    ``on_layer(LayerKV)`` if given); returns every layer, header and meta."""
    receiver = CacheReceiver(client, key, timeout_s, source)
    layers: List[LayerKV] = []
    for layer in receiver:
        if device is not None:
            layer.tensors = [t.to(device, non_blocking=True) for t in layer.tensors]
        if on_layer is not None:
            on_layer(layer)
        layers.append(layer)
    if not layers:
        raise CacheFormatError(f"transfer {key!r} holds no layers")
    return ReceivedCache(receiver.header, layers, receiver.meta, layers[0].arrived, layers[-1].arrived,
                         receiver.started)


def fingerprint(layers: Sequence[Sequence[Any]]) -> str:
    """sha256 over every tensor's shape, dtype and bytes, in order: equal on both sides iff the cache
    arrived bit for bit."""
    import torch
    h = hashlib.sha256()
    for tensors in layers:
        for t in tensors:
            t = t.detach().cpu().contiguous()
            h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
