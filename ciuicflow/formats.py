"""Byte layouts of every wire format: how many payload bytes a vector of ``numel`` elements takes in
chunks of ``chunk``, and the granule a chunk must be a multiple of. Pure arithmetic, no torch: the
leaf that the native ops' fake kernels (``ciuicflow.ops``), the codecs (``ciuicflow.compression``)
and the planner (``ciuicflow.plan``, through the registry) all read, so a layout is written once.

Every format also sends one float32 scale per chunk beside its payload (``SCALE_BYTES``).
"""
from __future__ import annotations


# elements per chunk that share one scale, where a caller names none: the 1-bit, int8 and int4
# compressors' default and the native ops'
DEFAULT_CHUNK_SIZE = 256
SCALE_BYTES = 4  # the float32 scale of each chunk

def onebit_payload_bytes(numel: int, chunk: int) -> int:
    """One sign bit per element, LSB first."""
    return -(-numel // 8)


def int8_payload_bytes(numel: int, chunk: int) -> int:
    return numel


def int4_payload_bytes(numel: int, chunk: int) -> int:
    """Two values per byte, low nibble first."""
    return -(-numel // 2)


# name -> (payload bytes of (numel, chunk), granule: a chunk holds a multiple of this many elements)
FORMATS = {
    "onebit": (onebit_payload_bytes, 8),
    "int8": (int8_payload_bytes, 1),
    "int4": (int4_payload_bytes, 2),
}


def bytes_per_element(name: str, chunk: int) -> float:
    """Wire bytes per element of format ``name`` in whole chunks of ``chunk`` elements: payload and
    scales."""
    payload_bytes, _ = FORMATS[name]
    return (payload_bytes(chunk, chunk) + SCALE_BYTES) / chunk
