"""4-bit quantisation with error feedback: two values (-7..7) per byte and one scale per chunk.

A method of its own (``hierarchical_int4``, ``int4``), and one of the codecs the 1-bit compressor
sends an adaptive optimizer's tensors with (``compression.policy``; why: docs/decisions.md): about
7.5x fewer bytes than float32 with a scale per 256 elements. The arithmetic is the native ops'
(``ciuicflow.ops.int4_pack``: int8's kernels with 15 levels).
"""
from __future__ import annotations

from ciuicflow import formats
from ciuicflow.compression.int8 import Int8Codec, IntCodec
from ciuicflow.compression.quantized import QuantizedCompressor, native_ops
from ciuicflow.compression.registry import FAMILIES

_COST = FAMILIES["int4"].cost


class Int4Codec(IntCodec):
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
    # the rung above int4 on the ladder an adaptive optimizer's tensor climbs (compression.policy)
    adaptive_codecs = {"int8": Int8Codec()}
    default_chunk_size = _COST.chunk_size
    default_error_decay = 1.0
    default_guard_threshold = _COST.guard_threshold
