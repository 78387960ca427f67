"""Names, limits and small helpers shared by the KV-flow client and sidecar (no torch, no grpc server)."""
from __future__ import annotations

import math
import re
from typing import Optional, Tuple

import grpc
import numpy       # imported up front: a first import in the middle of a transfer stalls it ~0.2 s

from . import kvflow_pb2 as pb

# gRPC metadata
FLOW_METADATA = "x-ciuic-flow"          # value "enabled" turns on flow control for a Send
PEER_METADATA = "x-ciuic-peer"          # the sending sidecar's name on a peer link
AUTH_METADATA = "authorization"         # "Bearer TOKEN"

LOCAL_SERVICE = "ciuicflow.kvflow.v1.KVFlow"
PEER_SERVICE = "ciuicflow.kvflow.v1.KVFlowPeer"

PRIORITY_NAMES = ("high", "normal", "low")
_PRIORITY_TO_PB = {"high": pb.HIGH, "normal": pb.NORMAL, "low": pb.LOW}
_PB_TO_PRIORITY = {pb.HIGH: "high", pb.NORMAL: "normal", pb.LOW: "low", pb.PRIORITY_UNSPECIFIED: "normal"}

PAYLOAD_KINDS = ("bytes", "tensors")
MAX_KEY_LEN = 1024

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
    """The gRPC status code of a status number carried in a message (UNKNOWN for numbers gRPC lacks)."""
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


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b|bit|bits|byte|bytes)?\s*$", re.I)


def parse_size(value, *, what: str = "size") -> int:
    """'256KiB', '1MiB', '1.5G', '100Mbit' (bits: divided by 8), 4096 -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{what} must not be negative")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"cannot read {what} {value!r} (examples: 262144, 256KiB, 1MiB, 100Mbit)")
    number, prefix, binary, unit = m.groups()
    base = 1024 if binary else 1000
    mult = {"": 1, "k": base, "m": base ** 2, "g": base ** 3, "t": base ** 4}[prefix.lower()]
    n = float(number) * mult
    if unit and unit.lower().startswith("bit"):
        n /= 8
    return int(n)


def parse_hostport(value: str, *, what: str = "address") -> Tuple[str, int]:
    value = str(value).strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_s = rest.lstrip(":")
    else:
        host, sep, port_s = value.rpartition(":")
        if not sep:
            raise ValueError(f"{what} {value!r} must be HOST:PORT")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"{what} {value!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{what} {value!r}: port out of range")
    return host or "0.0.0.0", port


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def uninitialized(n: int):
    """A writable buffer of ``n`` bytes that is about to be filled (a chunk from a socket or shared memory):
    not zeroed first. Zeroing a chunk-sized buffer costs about as much memory bandwidth as the copy that
    then fills it (~110 us per 885 KB here). Small ones are plain bytearrays."""
    if n < 1 << 16:
        return bytearray(n)
    return memoryview(numpy.empty(n, numpy.uint8))
