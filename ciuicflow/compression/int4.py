"""4-bit quantisation with error feedback: two values (-7..7) per byte and one scale per chunk.

The codec the 1-bit compressor sends an adaptive optimizer's tensors with where an exchange
quantises each value twice (``adaptive_optimizer="auto"``; ``compression.topmark`` where once;
docs/hooks.md "Adaptive optimizers"): 1-bit error feedback under Adam trains as if at a smaller
learning rate, and 4 bits do not (simulation of two nodes on ``charlm_adamw``, all of the error
carried: 4-bit 1.7764, int8 1.7766, 3-bit 1.7833, ternary 1.8744, 1-bit 1.8418, exact 1.7775),
at half of int8's bytes: about 7.5x fewer than float32 with a scale per 256 elements. The
arithmetic is the native ops' (``ciuicflow.ops.int4_pack``: int8's kernels with 15 levels).
"""
from __future__ import annotations

from ciuicflow import formats
from ciuicflow.compression.quantized import Codec, QuantizedCompressor, native_ops
from ciuicflow.compression.registry import FAMILIES

_COST = FAMILIES["int4"].cost


class Int4Codec(Codec):
    name = "int4"
    granule = 2  # two values per byte

    payload_bytes = staticmethod(formats.int4_payload_bytes)

    def pack(self, x, error, chunk):
        return native_ops().int4_pack(x, error, chunk)

    def unpack(self, payload, scales, numel, chunk, out, side=None):
        return native_ops().int4_unpack(payload, scales, numel, chunk, out=out)

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        return native_ops().int4_unpack_mean(payload, scales, numel, chunk, out=out)


class Int4Compressor(QuantizedCompressor):
    """``hierarchical_int4`` / ``int4``: classic error feedback (all of the error carried over, as
    int8's: it is below half a quantisation step per element)."""

    name = "int4"
    codec = Int4Codec()
    default_chunk_size = _COST.chunk_size
    default_error_decay = 1.0
    default_guard_threshold = _COST.guard_threshold
