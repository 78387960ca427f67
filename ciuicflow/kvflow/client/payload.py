"""What a client sends and receives: payloads as parts (tensors or bytes) and their SendData messages,
the results and errors of calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import grpc

from ..proto import kvflow_pb2 as pb

BYTES_PART_BYTES = 256 << 10         # a bytes payload is cut into parts of this size


class KVFlowError(Exception):
    """A transfer or call that failed; ``code`` is the gRPC status (DATA_LOSS, DEADLINE_EXCEEDED, ...)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> "KVFlowError":
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


@dataclass
class SendResult:
    key: str
    bytes: int
    chunks: int
    retransmits: int
    resumed_chunks: int
    seconds: float
    flow: bool


@dataclass
class Part:
    """One received part: a tensor (``value`` is a torch.Tensor) or a slice of bytes."""
    index: int
    value: Any
    name: str
    nbytes: int
    is_tensor: bool


@dataclass
class RecvHeader:
    key: str
    source: str
    payload_kind: str
    priority: str


# ---------------------------------------------------------------------- payload encoding
def _torch_is_tensor(value) -> bool:
    import sys
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def encode_part(index: int, value, name: str = ""):
    """(PartInfo, memoryview of the bytes) for a tensor or a bytes-like value."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value).cast("B") if not isinstance(value, bytes) else memoryview(value)
        return pb.PartInfo(index=index, nbytes=mv.nbytes, name=name), mv
    if _torch_is_tensor(value):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        import torch
        dtype = str(t.dtype).removeprefix("torch.")
        info = pb.PartInfo(index=index, nbytes=t.numel() * t.element_size(), name=name, dtype=dtype,
                           shape=list(t.shape), is_tensor=True)
        if t.numel() == 0:
            return info, memoryview(b"")
        flat = t.reshape(-1).view(torch.uint8)
        return info, memoryview(flat.numpy())
    raise TypeError(f"payload parts must be bytes-like or torch tensors, not {type(value).__name__}")


def decode_part(info: pb.PartInfo, buf: bytearray):
    if not info.is_tensor:
        return bytes(buf)
    import torch
    dtype = getattr(torch, info.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise KVFlowError(grpc.StatusCode.DATA_LOSS, f"unknown dtype {info.dtype!r} in part {info.index}")
    shape = tuple(info.shape)
    if info.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def messages(info: pb.PartInfo, mv: memoryview, message_bytes: int) -> Iterator[pb.SendRequest]:
    n = mv.nbytes
    if n == 0:
        yield pb.SendRequest(data=pb.SendData(part=info.index, offset=0, data=b"", info=info))
        return
    for off in range(0, n, message_bytes):
        data = bytes(mv[off:off + message_bytes])
        yield pb.SendRequest(data=pb.SendData(part=info.index, offset=off, data=data,
                                              info=info if off == 0 else None))


def split_payload(payload, message_bytes: int):
    """(payload_kind, [(info, memoryview)]) for bytes or a list of tensors/bytes."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        mv = memoryview(payload).cast("B") if not isinstance(payload, bytes) else memoryview(payload)
        step = min(message_bytes, BYTES_PART_BYTES)
        parts = [encode_part(i, mv[off:off + step])
                 for i, off in enumerate(range(0, mv.nbytes, step))]
        return "bytes", parts
    if _torch_is_tensor(payload):
        payload = [payload]
    if isinstance(payload, (list, tuple)):
        return "tensors", [encode_part(i, v) for i, v in enumerate(payload)]
    raise TypeError(f"payload must be bytes or a list of tensors, not {type(payload).__name__}")
