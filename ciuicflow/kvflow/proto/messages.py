"""Names, limits and checks of the protocol's messages, shared by the client and the sidecar."""
from __future__ import annotations

import math
from typing import Optional

import grpc

from . import kvflow_pb2 as pb

# gRPC metadata
FLOW_METADATA = "x-ciuic-flow"          # value "enabled" turns on flow control for a Send
PEER_METADATA = "x-ciuic-peer"          # the sending sidecar's name on a peer stream
AUTH_METADATA = "authorization"         # "Bearer TOKEN"

# Service names from the generated descriptors (health checking and reflection announce them).
LOCAL_SERVICE = pb.DESCRIPTOR.services_by_name["KVFlow"].full_name
PEER_SERVICE = pb.DESCRIPTOR.services_by_name["KVFlowPeer"].full_name

PRIORITY_NAMES = ("high", "normal", "low")
_PRIORITY_TO_PB = {"high": pb.HIGH, "normal": pb.NORMAL, "low": pb.LOW}
_PB_TO_PRIORITY = {pb.HIGH: "high", pb.NORMAL: "normal", pb.LOW: "low", pb.PRIORITY_UNSPECIFIED: "normal"}

PAYLOAD_KINDS = ("bytes", "tensors")
MAX_KEY_LEN = 1024
MAX_PART_NAME = 1024            # characters of a part's name
MAX_DIMS = 32                   # dimensions of a tensor part
MAX_PART_BYTES = 1 << 48        # a part's declared size (256 TiB): more is a lie, not a layer
MAX_PACKED_PARTS = 64           # whole parts in one packed chunk (Chunk.info and Chunk.more): what a sender packs
#                                 (sidecar.ingest) and what a receiver accepts, live or from its spool
MAX_PART_INFO_BYTES = 8 << 10   # a serialized PartInfo: far above any valid one (name, 32 dims, dtype)

# torch dtype name -> bytes per element (the sidecar validates tensor parts without importing torch)
DTYPE_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
}

_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status of a status number carried in a message (``Abort.code``, ``Ack.error_code``, ...);
    grpc's Python API maps only its own calls' statuses. UNKNOWN for numbers gRPC lacks."""
    return _CODE_BY_VALUE.get(int(value), grpc.StatusCode.UNKNOWN)


def priority_to_pb(name: str) -> int:
    try:
        return _PRIORITY_TO_PB[name]
    except KeyError:
        raise ValueError(f"priority must be one of {PRIORITY_NAMES}, got {name!r}") from None


def priority_from_pb(value: int) -> Optional[str]:
    return _PB_TO_PRIORITY.get(value)


def check_key(key: str) -> Optional[str]:
    """An error message for a bad transfer key, or None."""
    if not key:
        return "key must not be empty"
    if len(key) > MAX_KEY_LEN:
        return f"key longer than {MAX_KEY_LEN} characters"
    if "\x00" in key:
        return "key must not contain NUL"
    return None


def check_part_info(info: "pb.PartInfo", expected_index: int) -> Optional[str]:
    """An error message for a malformed part description, or None."""
    if info.index != expected_index:
        return f"part info index {info.index} does not match part {expected_index}"
    if len(info.name) > MAX_PART_NAME:
        return f"part {expected_index}: name longer than {MAX_PART_NAME} characters"
    if info.nbytes > MAX_PART_BYTES:
        return f"part {expected_index}: {info.nbytes} bytes declared, more than {MAX_PART_BYTES}"
    if len(info.shape) > MAX_DIMS:
        return f"part {expected_index}: more than {MAX_DIMS} dimensions"
    if info.is_tensor:
        size = DTYPE_ITEMSIZE.get(info.dtype)
        if size is None:
            return f"part {expected_index}: unknown dtype {info.dtype!r}"
        if any(d < 0 for d in info.shape):
            return f"part {expected_index}: negative dimension in shape {list(info.shape)}"
        numel = math.prod(info.shape) if len(info.shape) else 1
        if numel * size != info.nbytes:
            return (f"part {expected_index}: shape {list(info.shape)} of {info.dtype} needs {numel * size} bytes,"
                    f" part says {info.nbytes}")
    elif info.dtype or len(info.shape):
        return f"part {expected_index}: dtype/shape given for a bytes part"
    return None
