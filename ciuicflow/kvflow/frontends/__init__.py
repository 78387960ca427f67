"""Inference-engine frontends: KV caches <-> KV-flow transfers. ``format`` (the transfer's parts, receiving
layer by layer), ``transformers_cache`` (a transformers Cache, sent while prefill runs, rebuilt on the decode
side), ``paged`` (an inference server's paged blocks). Their public names are importable from here."""
from .format import (FORMAT, HEADER_NAME, LAYOUTS, META_NAME, CacheFormatError, CacheReceiver, LayerKV,
                     ReceivedCache, fingerprint, receive_layers, send_tensors)
from .paged import gather_blocks, recv_blocks, scatter_blocks, send_blocks
from .transformers_cache import (MLA_MODEL_TYPES, LayerStreamer, build_dynamic_cache, cache_header, cache_layers,
                                 check_layout, decoder_layers, detect_layout, layer_kv, local_cache_layout,
                                 recv_cache, send_cache)

__all__ = ["FORMAT", "HEADER_NAME", "LAYOUTS", "META_NAME", "MLA_MODEL_TYPES", "CacheFormatError", "CacheReceiver",
           "LayerKV", "LayerStreamer", "ReceivedCache", "build_dynamic_cache", "cache_header", "cache_layers",
           "check_layout", "decoder_layers", "detect_layout", "fingerprint", "gather_blocks", "layer_kv",
           "local_cache_layout", "receive_layers", "recv_blocks", "recv_cache", "scatter_blocks", "send_blocks",
           "send_cache", "send_tensors"]
