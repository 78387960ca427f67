"""Encoding and decoding of messages that both ends share: peer chunk frames built and read without
copying their data, deserializers that report malformed bytes instead of raising, receive buffers."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy       # imported at startup: a first import in the middle of a transfer would stall it

from . import kvflow_pb2 as pb

MALFORMED = object()      # what a safe deserializer returns for bytes that are not the expected message


def safe_deserializer(from_string):
    """``from_string`` (a message class's FromString) returning MALFORMED instead of raising, so the
    handler answers INVALID_ARGUMENT itself rather than gRPC failing the call with its own status."""
    def deserialize(data: bytes):
        try:
            return from_string(data)
        except Exception:       # noqa: BLE001 - reported as INVALID_ARGUMENT by the handler
            return MALFORMED
    return deserialize


def uninitialized(n: int):
    """A writable buffer of ``n`` bytes that is about to be filled (a frame from a socket, a chunk from shared
    memory): not zeroed first, since zeroing costs about as much memory bandwidth as the copy that then
    fills it. Small ones are plain bytearrays."""
    if n < 1 << 16:
        return bytearray(n)
    return memoryview(numpy.empty(n, numpy.uint8))


# ---------------------------------------------------------------------- peer chunk frames, by hand
_CHUNK_FIELD = (2 << 3) | 2         # PeerFrame.chunk, length-delimited
_DATA_FIELD_NUMBER = 6              # Chunk.data
_DATA_FIELD = (_DATA_FIELD_NUMBER << 3) | 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def chunk_frame_prefix(chunk: pb.Chunk, n: int) -> bytes:
    """The bytes of a serialized ``PeerFrame(chunk=...)`` that come before its ``n`` bytes of data: the
    frame is built without copying the data into a protobuf message first (a copy that costs more than
    all the rest of a chunk's handling; docs/kvflow.md, Peer frames). Prefix + data parse as the same
    PeerFrame: protobuf fields may come in any order."""
    head = chunk.SerializeToString()
    if not n:
        return bytes((_CHUNK_FIELD,)) + _varint(len(head)) + head
    data_len = _varint(n)
    inner_len = len(head) + 1 + len(data_len) + n
    return b"".join((bytes((_CHUNK_FIELD,)), _varint(inner_len), head, bytes((_DATA_FIELD,)), data_len))


def encode_chunk_frame(chunk: pb.Chunk, data) -> bytes:
    """A serialized ``PeerFrame(chunk=...)`` whose ``data`` is ``data`` (see ``chunk_frame_prefix``)."""
    return chunk_frame_prefix(chunk, len(data)) + data


class ChunkFrame:
    """A ``PeerFrame(chunk=...)`` read without copying its data: ``chunk`` has every field but ``data``,
    which is ``data``, a view of the received buffer (protobuf would copy it twice: parsing, and reading
    the field)."""
    __slots__ = ("chunk", "data")

    def __init__(self, chunk: pb.Chunk, data):
        self.chunk, self.data = chunk, data

    @staticmethod
    def WhichOneof(_group: str) -> str:
        return "chunk"


def _varint_at(buf, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def parse_chunk_frame(payload) -> Optional[ChunkFrame]:
    """``payload`` as a ChunkFrame when it is a PeerFrame holding only a chunk; None otherwise (or when
    anything is off: the caller then lets protobuf parse it, and judge it)."""
    try:
        if not payload or payload[0] != _CHUNK_FIELD:
            return None
        inner_len, start = _varint_at(payload, 1)
        if start + inner_len != len(payload):
            return None
        pos, rest, data = start, [], b""
        while pos < len(payload):
            field_start = pos
            tag, pos = _varint_at(payload, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint_at(payload, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                n, pos = _varint_at(payload, pos)
                if tag >> 3 == _DATA_FIELD_NUMBER:
                    if pos + n > len(payload):
                        return None
                    data = memoryview(payload)[pos:pos + n]
                    pos += n
                    continue
                pos += n
            else:
                return None
            if pos > len(payload):
                return None
            rest.append(bytes(payload[field_start:pos]))
        return ChunkFrame(pb.Chunk.FromString(b"".join(rest)), data)
    except Exception:       # noqa: BLE001 - protobuf decides
        return None
