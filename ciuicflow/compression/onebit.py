"""1-bit compression with error feedback: the sign of every element and one scale per chunk.

A chunk's scale is the mean |value| of its elements (the L2-optimal scale for sign compression),
so a chunk spanning elements of different size sends the small ones a large +-scale (noise) and
the large ones too little (delay): the chunk is short by default. On every all-reduce route,
chunks of concentrated windows also send their largest values (``compression.outliers``; only
such chunks carry them). Why each default: docs/decisions.md.
"""
from __future__ import annotations

import torch

from ciuicflow import formats
from ciuicflow.compression.int4 import Int4Codec
from ciuicflow.compression.int8 import Int8Codec
from ciuicflow.compression.outliers import MAX_CHUNK, OneBitOutlierCodec
from ciuicflow.compression.quantized import Codec, QuantizedCompressor, QuantizedErrors, \
    native_ops, quantized_all_reduce
from ciuicflow.compression.refined import RefinedOneBitCodec
from ciuicflow.compression.registry import FAMILIES

_COST = FAMILIES["onebit"].cost
DEFAULT_CHUNK_SIZE = _COST.chunk_size  # also the native ops' default (ciuicflow.ops)


class OneBitCodec(Codec):
    name = "onebit"
    granule = 8  # eight signs per byte

    payload_bytes = staticmethod(formats.onebit_payload_bytes)

    def pack(self, x, error, chunk):
        return native_ops().onebit_pack(x, error, chunk)

    def pack_ef(self, x, error, error_decay, error_out, chunk, measure=True, units=None):
        if units is not None:  # an adaptive optimizer's tensor sent as 1 bit (an option)
            return super().pack_ef(x, error, error_decay, error_out, chunk, measure, units)
        # one native pass; its sums cost nothing, so they come whether measured or not
        return native_ops().onebit_pack_ef(x, error, error_decay, error_out, chunk)

    def unpack(self, payload, scales, numel, chunk, out, side=None):
        return native_ops().onebit_unpack(payload, scales, numel, chunk, out=out)

    def unpack_mean(self, payload, scales, numel, chunk, out, side=None):
        return native_ops().onebit_unpack_mean(payload, scales, numel, chunk, out=out)


class Int8InOneBitLayout(Int8Codec):
    """int8 chunks laid out as 1-bit's (whole bytes of signs per chunk), so one error memory
    serves a tensor whichever of the codecs sends it."""

    granule = OneBitCodec.granule


class Int4InOneBitLayout(Int4Codec):
    """int4 chunks laid out as 1-bit's, as ``Int8InOneBitLayout``."""

    granule = OneBitCodec.granule


class OneBitCompressor(QuantizedCompressor):
    """``hierarchical_1bit`` / ``onebit``: 256 elements per scale, half of the error carried over,
    values for concentrated windows on the all-reduce routes, the guard warning past 4x; what a
    tensor carries beyond that (its phases, the servers' codec, an adaptive optimizer's codec) is
    ``compression.policy``'s. Why each default: docs/decisions.md."""

    name = "onebit"
    codec = OneBitCodec()
    adaptive_codecs = {"int4": Int4InOneBitLayout(), "int8": Int8InOneBitLayout()}
    # what the servers of two phases may send (``server_codec``; registry.SERVER_FAMILY): int4 in
    # 1 bit's layout, or 1 bit with int4 in the tenth of the chunks where 1 bit errs most
    server_codecs = {"int4": adaptive_codecs["int4"], "onebit_int4": RefinedOneBitCodec()}
    option_names = QuantizedCompressor.option_names + ("outliers",)
    default_chunk_size = DEFAULT_CHUNK_SIZE
    default_error_decay = 0.5
    default_guard_threshold = _COST.guard_threshold
    default_outliers = _COST.values

    def __init__(self, *, outliers="auto", **options):
        """``outliers``: values each chunk of a concentrated window also sends
        (``compression.outliers``): an int in [0, 16] on every all-reduce route, or "auto" (the
        default): the registry's ``values`` (4) on every all-reduce route -- DDP's, flat and
        hierarchical, and HSDP's replicas in ciuicflow.fsdp -- where ``chunk_size`` <= 256. Only
        chunks that send values carry their bytes (12 at 4 values). FSDP's compressed
        reduce-scatter (route None) sends none. Why: docs/decisions.md."""
        super().__init__(**options)
        # the refined codec's plain chunks carry this state's share of their memory
        self.server_codecs = {**self.server_codecs,
                              "onebit_int4": RefinedOneBitCodec(plain_decay=self.error_decay)}
        if outliers != "auto" and (isinstance(outliers, bool) or not isinstance(outliers, int)
                                   or not 0 <= outliers <= 16):
            raise ValueError(f"outliers must be an int in [0, 16] or 'auto', got {outliers!r}")
        if outliers not in ("auto", 0) and self.chunk_size > MAX_CHUNK:
            raise ValueError(f"outliers need chunk_size <= {MAX_CHUNK} (a position is one byte), "
                             f"got chunk_size={self.chunk_size}")
        self.outliers = outliers
        count = self.default_outliers if outliers == "auto" else outliers
        self._outlier_codec = OneBitOutlierCodec(count) \
            if count and self.chunk_size <= MAX_CHUNK else None

    def own_codec(self, route=None):
        if self._outlier_codec is None:
            return self.codec
        # the reduce-scatter (route None) lays its rows out at fixed sizes: no side blocks there
        if route is None:
            return self.codec
        return self._outlier_codec


def onebit_all_reduce(tensor: torch.Tensor, errors: QuantizedErrors, topology=None, *,
                      hierarchical: bool = True, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      exact_mask: torch.Tensor | None = None, error_decay: float = 1.0,
                      server: bool = True, guard_threshold: float | None = None,
                      measure: bool = True, guard: str | None = None,
                      traffic=None) -> torch.Tensor:
    """Average ``tensor`` in place over the topology's group with 1-bit compression; return it.

    ``hierarchical=True`` compresses only the inter-node step of the hierarchical all-reduce (on a
    single node the all-reduce is then exact); ``False`` compresses all traffic, flat over the
    group. ``errors`` (a ``QuantizedErrors``) persists between calls for the same tensor.
    ``exact_mask`` (bool, same numel) marks positions reduced exactly. ``error_decay``: the share
    of the memory carried over (1: classic error feedback); ``server``: two phases (True) or one;
    ``guard_threshold``: past it (the memory's ``relative_error``), the step sends exactly what it
    would have compressed; ``measure``: compute that measure; ``guard``: the state's option of
    that name (default: "exact" with a threshold, else "warn"; "off" without ``measure``).
    ``traffic`` accumulates the bytes sent."""
    compressor = OneBitCompressor(
        chunk_size=chunk_size, error_decay=error_decay, phases=2 if server else 1,
        guard=guard or ("off" if not measure else
                        ("exact" if guard_threshold is not None else "warn")),
        guard_threshold=guard_threshold if guard_threshold is not None else
        OneBitCompressor.default_guard_threshold)
    return quantized_all_reduce(compressor, tensor, errors, topology, hierarchical=hierarchical,
                                exact_mask=exact_mask, traffic=traffic)
