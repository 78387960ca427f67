"""Byte layouts of every wire format: how many payload bytes a vector of ``numel`` elements takes in
chunks of ``chunk``, and the granule a chunk must be a multiple of. Pure arithmetic, no torch: the
leaf that the native ops' fake kernels (``ciuicflow.ops``), the codecs (``ciuicflow.compression``)
and the planner (``ciuicflow.plan``, through the registry) all read, so a layout is written once.

Every format also sends one float32 scale per chunk beside its payload (``SCALE_BYTES``).
"""
from __future__ import annotations

import functools
import math

# elements per chunk that share one scale, where a caller names none: the 1-bit, int8 and int4
# compressors' default and the native ops'
DEFAULT_CHUNK_SIZE = 256
SCALE_BYTES = 4  # the float32 scale of each chunk

# topmark: its own chunk, whatever the compressor's (the native ops' largest: topmark_common.h's
# kMaxChunk)
TOPMARK_CHUNK = 512


def onebit_payload_bytes(numel: int, chunk: int) -> int:
    """One sign bit per element, LSB first."""
    return -(-numel // 8)


def int8_payload_bytes(numel: int, chunk: int) -> int:
    return numel


def int4_payload_bytes(numel: int, chunk: int) -> int:
    """Two values per byte, low nibble first."""
    return -(-numel // 2)


def twobit_payload_bytes(numel: int, chunk: int) -> int:
    """Per chunk a low-magnitude byte and 2-bit codes (four per byte); a trimmed last chunk has its
    byte and ceil(its elements / 4) bytes of codes. No branch on the sizes: the native op's fake
    kernel calls this with symbolic ones."""
    rest = numel % chunk
    # -(-rest // chunk) is 1 where a trimmed chunk is left, else 0
    return numel // chunk * (1 + chunk // 4) - (-rest // chunk) - (-rest // 4)


def topmark_marked(length: int) -> int:
    """Elements a topmark chunk of ``length`` marks large: 55/512 of them, rounded (55 of 512: the
    most whose rank fits 31 bytes), at least one (the scale is the marked elements' mean: the
    others' byte needs it)."""
    return max(1, (length * 55 + 256) // 512) if length else 0


@functools.cache
def topmark_rank_bytes(length: int) -> int:
    """Bytes of a topmark chunk's rank: enough for C(length, marked(length)) - 1."""
    return ((math.comb(length, topmark_marked(length)) - 1).bit_length() + 7) // 8


def topmark_block_bytes(chunk: int) -> int:
    """A topmark chunk's block: its signs, the low-magnitude byte and the rank of its marks."""
    return chunk // 8 + 1 + topmark_rank_bytes(chunk)


def topmark_payload_bytes(numel: int, chunk: int) -> int:
    """Whole blocks: a trimmed last chunk has a whole chunk's block."""
    return -(-numel // chunk) * topmark_block_bytes(chunk)


# name -> (payload bytes of (numel, chunk), granule: a chunk holds a multiple of this many elements,
# the format's own chunk or 0 for the compressor's)
FORMATS = {
    "onebit": (onebit_payload_bytes, 8, 0),
    "int8": (int8_payload_bytes, 1, 0),
    "int4": (int4_payload_bytes, 2, 0),
    "twobit": (twobit_payload_bytes, 8, 0),
    "topmark": (topmark_payload_bytes, 8, TOPMARK_CHUNK),
}


def bytes_per_element(name: str, chunk: int) -> float:
    """Wire bytes per element of format ``name`` in whole chunks of ``chunk`` elements (its own chunk
    where it has one): payload and scales."""
    payload_bytes, _, own_chunk = FORMATS[name]
    chunk = own_chunk or chunk
    return (payload_bytes(chunk, chunk) + SCALE_BYTES) / chunk
