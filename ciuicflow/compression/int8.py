"""int8 quantisation with error feedback: one byte per element and one scale per chunk.

A chunk's scale is max |value| / 127, so every element is sent to within half a step of 1/127 of
its chunk's largest: the error feedback then carries little, and accuracy stays at exact training's
where 1-bit's large per-step error costs it. 256 elements per scale (the registry's default) cost
1/8 bit per element: about 3.9x fewer bytes than float32.
"""
from __future__ import annotations

import torch

from ciuicflow import formats
from ciuicflow.compression.quantized import Codec, QuantizedCompressor, native_ops
from ciuicflow.compression.registry import FAMILIES

_COST = FAMILIES["int8"].cost


class IntCodec(Codec):
    """int8's and int4's: on CPU the error feedback, the optimizer's units and the guard's sums
    are one native pass with the pack (``ops.int8_pack_ef``, ``ops.int4_pack_ef``); elsewhere
    ``Codec``'s torch ops, which round every step as the native pass does."""

    def pack_ef(self, x, error, error_decay, error_out, chunk, measure=True, units=None):
        if x.device.type != "cpu":
            return super().pack_ef(x, error, error_decay, error_out, chunk, measure, units)
        pack_ef = getattr(native_ops(), f"{self.name}_pack_ef")
        values, scales, sums = pack_ef(x, error, error_decay, error_out, chunk, units)
        return values.view(torch.uint8), scales, sums  # rows of the exchange are bytes


class Int8Codec(IntCodec):
    name = "int8"
    granule = 1

    payload_bytes = staticmethod(formats.int8_payload_bytes)

    def pack(self, x, error, chunk):
        values, scales = native_ops().int8_pack(x, error, chunk)
        return values.view(torch.uint8), scales  # rows of the exchange are bytes

    def unpack(self, payload, scales, numel, chunk, out, side=None):
        return native_ops().int8_unpack(payload.view(torch.int8), scales, numel, chunk, out=out)

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        return native_ops().int8_unpack_mean(payload.view(torch.int8), scales, numel, chunk, out=out)


class Int8Compressor(QuantizedCompressor):
    """``hierarchical_int8`` / ``int8``: classic error feedback (all of the error carried over:
    it is below half a quantisation step per element, too small to turn into oscillation)."""

    name = "int8"
    codec = Int8Codec()
    default_chunk_size = _COST.chunk_size
    default_error_decay = 1.0
    default_guard_threshold = _COST.guard_threshold
