"""Encoding and decoding of messages that both ends share: peer chunk frames built and read without
copying their data, deserializers that report malformed bytes instead of raising, receive buffers."""
from __future__ import annotations

from typing import Tuple

import numpy       # imported at startup: a first import in the middle of a transfer would stall it

from . import kvflow_pb2 as pb
from .messages import MAX_PACKED_PARTS, MAX_PART_INFO_BYTES

MALFORMED = object()      # what a safe deserializer returns for bytes that are not the expected message


def safe_deserializer(from_string):
    """``from_string`` (a message class's FromString) returning MALFORMED instead of raising, so the
    handler answers INVALID_ARGUMENT itself rather than gRPC failing the call with its own status. A
    peer's frames (PeerFrame) go through parse_peer_frame, on every transport: chunks read with bounds."""
    def deserialize(data: bytes):
        try:
            return from_string(data)
        except Exception:       # noqa: BLE001 - reported as INVALID_ARGUMENT by the handler
            return MALFORMED
    if getattr(from_string, "__self__", None) is pb.PeerFrame:
        return lambda data: parse_peer_frame(data, deserialize)
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
_MORE_FIELD_NUMBER = 9              # Chunk.more
_PART_INFO_FIELDS = (8, _MORE_FIELD_NUMBER)     # Chunk.info, Chunk.more
_CHUNK_FIELDS = 16                  # a chunk's fields besides its part descriptions, with room to spare
_FRAME_FIELDS = 4                   # a PeerFrame is one field (a oneof); a few more are tolerated


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


def _fields(payload, pos: int):
    """(field number, start of the field, start of its value, end) of each field from ``pos`` on; raises
    ValueError where the bytes are not fields."""
    while pos < len(payload):
        field_start = pos
        tag, pos = _varint_at(payload, pos)
        wire_type = tag & 7
        value = pos
        if wire_type == 0:
            _, pos = _varint_at(payload, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            n, value = _varint_at(payload, pos)
            pos = value + n
        else:
            raise ValueError(f"wire type {wire_type}")
        if pos > len(payload):
            raise ValueError("truncated field")
        yield tag >> 3, field_start, value, pos


def parse_chunk_frame(payload):
    """``payload`` as a ChunkFrame when it is a PeerFrame holding only a chunk; None otherwise (or when
    anything is off: the caller then lets protobuf parse it, and judge it); MALFORMED for a chunk no sender
    writes (a part description over MAX_PART_INFO_BYTES, too many fields).

    Part descriptions are bounded before protobuf expands them: a frame holds millions of zero-byte ones,
    and each costs hundreds of bytes once parsed. A packed chunk with more than MAX_PACKED_PARTS parts is
    read up to its first MAX_PACKED_PARTS + 1 (the receiver refuses it by that count); the rest of the
    frame, its data included, is not read."""
    try:
        if not payload or payload[0] != _CHUNK_FIELD:
            return None
        inner_len, start = _varint_at(payload, 1)
        if start + inner_len != len(payload):
            return None
        rest, data, more = [], b"", 0
        for field, field_start, value, end in _fields(payload, start):
            if field == _DATA_FIELD_NUMBER:
                data = memoryview(payload)[value:end]
                continue
            if field in _PART_INFO_FIELDS and end - value > MAX_PART_INFO_BYTES:
                return MALFORMED
            rest.append(bytes(payload[field_start:end]))
            more += field == _MORE_FIELD_NUMBER
            if more >= MAX_PACKED_PARTS:
                break       # with Chunk.info, one part too many: refused by count
            if len(rest) > _CHUNK_FIELDS + MAX_PACKED_PARTS:
                return MALFORMED
        return ChunkFrame(pb.Chunk.FromString(b"".join(rest)), data)
    except Exception:       # noqa: BLE001 - protobuf decides
        return None


def _holds_no_chunk(payload) -> bool:
    """Whether ``payload`` is a PeerFrame of a few fields, none of them a chunk: every chunk goes through
    parse_chunk_frame's bounds (its senders write it as the frame's only field), never protobuf's parser."""
    try:
        for count, (field, _, _, _) in enumerate(_fields(payload, 0)):
            if field == _CHUNK_FIELD >> 3 or count >= _FRAME_FIELDS:
                return False
    except ValueError:
        return False
    return True


def parse_peer_frame(payload, parse):
    """A peer's frame (bytes): a chunk through parse_chunk_frame, any other frame through ``parse``
    (protobuf's); MALFORMED for a chunk parse_chunk_frame cannot read."""
    frame = parse_chunk_frame(payload)
    if frame is not None:
        return frame
    return parse(payload) if _holds_no_chunk(payload) else MALFORMED
