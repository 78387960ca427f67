"""Python client of the KV-flow sidecar's local API.

    from ciuicflow.kvflow import Client
    client = Client("127.0.0.1:50151")
    handle = client.send("decode0", "req-17", [k0, v0, k1, v1], priority="high", deadline_s=1.0)
    handle.wait()                                   # delivered to decode0's sidecar (or KVFlowError)

    # on decode0, beside its own sidecar:
    tensors = Client("127.0.0.1:50151").recv("req-17", timeout_s=5)
    for part in client.recv_stream("req-17", timeout_s=5):   # parts as they arrive
        use(part.index, part.value)

    # layer by layer while prefill runs:
    with client.open("decode0", "req-18", priority="high") as stream:
        for layer in model_layers:
            stream.append(run(layer), name=f"layer.{i}")
    stream.handle.wait()

Payloads are bytes (returned as bytes) or a list of torch tensors (returned as tensors with the same dtype and
shape, on the CPU). A list may mix tensors and bytes. torch is imported only when tensors are used.
"""
from __future__ import annotations

import json
import queue
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Union

import grpc

from .common import AUTH_METADATA, FLOW_METADATA, PRIORITY_NAMES, priority_from_pb, priority_to_pb
from .proto import kvflow_pb2 as pb
from .proto import kvflow_pb2_grpc as pb_grpc

DEFAULT_MESSAGE_BYTES = 1 << 20      # largest SendData message: a KV layer of up to 1 MiB is one message
BYTES_PART_BYTES = 256 << 10         # a bytes payload is cut into parts of this size
_END = object()


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


def _messages(info: pb.PartInfo, mv: memoryview, message_bytes: int) -> Iterator[pb.SendRequest]:
    n = mv.nbytes
    if n == 0:
        yield pb.SendRequest(data=pb.SendData(part=info.index, offset=0, data=b"", info=info))
        return
    for off in range(0, n, message_bytes):
        data = bytes(mv[off:off + message_bytes])
        yield pb.SendRequest(data=pb.SendData(part=info.index, offset=off, data=data,
                                              info=info if off == 0 else None))


def _split_payload(payload, message_bytes: int):
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


# ---------------------------------------------------------------------- handles
class SendHandle:
    """A transfer in progress. ``wait()`` returns a SendResult once the destination sidecar holds all of it."""

    def __init__(self, future, key: str, dest: str):
        self._future = future
        self.key = key
        self.dest = dest

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()

    def wait(self, timeout: Optional[float] = None) -> SendResult:
        try:
            r = self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"transfer {self.key!r} to {self.dest!r} still running after {timeout}s") from None
        except grpc.FutureCancelledError:
            raise KVFlowError(grpc.StatusCode.CANCELLED, f"transfer {self.key!r} was cancelled") from None
        except grpc.RpcError as exc:
            raise KVFlowError.from_rpc(exc) from None
        return SendResult(r.key, r.bytes, r.chunks, r.retransmits, r.resumed_chunks, r.seconds, r.flow)

    result = wait


class SendStream:
    """An open transfer: ``append`` parts (e.g. one layer's cache) as they are produced, then ``close()``.

    ``append`` blocks when the sidecar is over its memory cap (backpressure) and raises KVFlowError as soon
    as the transfer has failed. Used as a context manager, it closes on success and cancels on an exception.
    """

    def __init__(self, client: "Client", dest: str, key: str, priority: str, deadline_s, flow: bool,
                 lease_s, resume: bool, payload_kind: str, queue_messages: int):
        self.dest = dest
        self.key = key
        self._message_bytes = client.message_bytes
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, queue_messages))
        self._parts = 0
        self._closed = False
        header = pb.SendRequest(header=pb.SendHeader(
            dest=dest, key=key, priority=priority_to_pb(priority), deadline_s=float(deadline_s or 0.0),
            payload_kind=payload_kind, resume=resume, lease_s=float(lease_s or 0.0)))
        future = client._send_stub(priority).Send.future(self._requests(header), metadata=client._metadata(flow),
                                          timeout=client._call_timeout(deadline_s))
        self.handle = SendHandle(future, key, dest)

    def _requests(self, header):
        yield header
        while True:
            item = self._queue.get()
            if item is _END:
                yield pb.SendRequest(end=pb.SendEnd(num_parts=self._parts))
                return
            yield item

    def _put(self, item) -> None:
        while True:
            if self.handle.done():
                self.handle.wait()      # raises the transfer's error
                raise KVFlowError(grpc.StatusCode.FAILED_PRECONDITION, f"transfer {self.key!r} already finished")
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def append(self, value, name: str = "") -> int:
        """Add one part (a tensor or bytes); returns its index."""
        if self._closed:
            raise RuntimeError("append after close")
        info, mv = encode_part(self._parts, value, name)
        for msg in _messages(info, mv, self._message_bytes):
            self._put(msg)
        self._parts += 1
        return info.index

    def extend(self, values: Iterable) -> None:
        for v in values:
            self.append(v)

    def close(self) -> SendHandle:
        if not self._closed:
            self._closed = True
            self._put(_END)
        return self.handle

    def cancel(self) -> None:
        self._closed = True
        self.handle.cancel()

    def __enter__(self) -> "SendStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class RecvStream:
    """Iterator over the parts of a transfer as they arrive; ``header`` is set once the transfer is found."""

    def __init__(self, call):
        self._call = call
        self.header: Optional[RecvHeader] = None
        self._it = self._parts()

    def __iter__(self) -> "RecvStream":
        return self

    def __next__(self) -> Part:
        return next(self._it)

    def cancel(self) -> None:
        self._call.cancel()

    close = cancel

    def _parts(self) -> Iterator[Part]:
        info = None
        buf = None
        filled = 0
        try:
            for reply in self._call:
                kind = reply.WhichOneof("msg")
                if kind == "header":
                    h = reply.header
                    self.header = RecvHeader(h.key, h.source, h.payload_kind, priority_from_pb(h.priority) or "normal")
                    continue
                d = reply.data
                if d.HasField("info") and d.offset == 0:
                    info = d.info
                    filled = 0
                    if len(d.data) == info.nbytes and not info.is_tensor:
                        buf = None          # a part in one chunk: use the message's bytes as they are
                        yield Part(info.index, d.data, info.name, info.nbytes, False)
                        info = None
                        continue
                    buf = bytearray(info.nbytes)
                if info is None or d.part != info.index or d.offset != filled or filled + len(d.data) > info.nbytes:
                    raise KVFlowError(grpc.StatusCode.DATA_LOSS, f"chunk out of order from the sidecar "
                                      f"(part {d.part} offset {d.offset})")
                buf[filled:filled + len(d.data)] = d.data
                filled += len(d.data)
                if filled == info.nbytes:
                    yield Part(info.index, decode_part(info, buf), info.name, info.nbytes, info.is_tensor)
                    info = None
                    buf = None
        except grpc.RpcError as exc:
            raise KVFlowError.from_rpc(exc) from None


# ---------------------------------------------------------------------- the client
class Client:
    """Talks to the sidecar beside this process (its ``--api`` address).

    ``flow`` (default True) sends metadata ``x-ciuic-flow: enabled`` so transfers are chunk-scheduled and
    congestion-controlled; ``flow=False`` gives the plain FIFO baseline. ``token``: the sidecar's
    ``--api-token`` if it has one.
    """

    def __init__(self, address: str, *, flow: bool = True, token: Optional[str] = None,
                 message_bytes: int = DEFAULT_MESSAGE_BYTES, queue_messages: int = 8):
        self.address = address
        self.flow = flow
        self.token = token
        self.message_bytes = int(message_bytes)
        self.queue_messages = queue_messages
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.KVFlowStub(self._channel)
        # High-priority sends get a connection of their own: on a shared one their bytes queue behind the
        # bulk streams' data in the same TCP socket and HTTP/2 connection window.
        self._high_channel = grpc.insecure_channel(address, options=options + [
            ("grpc.use_local_subchannel_pool", 1)])
        self._high_stub = pb_grpc.KVFlowStub(self._high_channel)

    def _send_stub(self, priority: str):
        return self._high_stub if priority == "high" else self._stub

    def _metadata(self, flow: Optional[bool]):
        md = []
        if self.flow if flow is None else flow:
            md.append((FLOW_METADATA, "enabled"))
        if self.token:
            md.append((AUTH_METADATA, f"Bearer {self.token}"))
        return tuple(md)

    @staticmethod
    def _call_timeout(deadline_s) -> Optional[float]:
        # The sidecar enforces deadlines with an explicit status; this is only a backstop.
        return float(deadline_s) + 30.0 if deadline_s else None

    @staticmethod
    def _check_priority(priority: str) -> None:
        if priority not in PRIORITY_NAMES:
            raise ValueError(f"priority must be one of {PRIORITY_NAMES}, got {priority!r}")

    # ------------------------------------------------------------------ sending
    def send(self, dest: str, key: str, payload, priority: str = "normal", deadline_s: Optional[float] = None,
             *, flow: Optional[bool] = None, lease_s: Optional[float] = None, resume: bool = False) -> SendHandle:
        """Send ``payload`` (bytes, or a list of tensors) to peer ``dest`` under ``key``; returns at once.

        Tensors are read when their turn comes: do not modify them before ``handle.wait()`` returns.
        ``resume``: when retrying after a failed attempt (e.g. this side's sidecar died mid-transfer), set it so
        that chunks the receiver already holds with the same checksum are not sent again; without it a
        partial transfer of this key from this sidecar is discarded and sent from the start.
        """
        self._check_priority(priority)
        kind, parts = _split_payload(payload, self.message_bytes)
        header = pb.SendRequest(header=pb.SendHeader(
            dest=dest, key=key, priority=priority_to_pb(priority), deadline_s=float(deadline_s or 0.0),
            payload_kind=kind, resume=resume, lease_s=float(lease_s or 0.0)))
        message_bytes = self.message_bytes

        def requests():
            yield header
            for info, mv in parts:
                yield from _messages(info, mv, message_bytes)
            yield pb.SendRequest(end=pb.SendEnd(num_parts=len(parts)))

        future = self._send_stub(priority).Send.future(requests(), metadata=self._metadata(flow),
                                        timeout=self._call_timeout(deadline_s))
        return SendHandle(future, key, dest)

    def open(self, dest: str, key: str, priority: str = "normal", deadline_s: Optional[float] = None, *,
             flow: Optional[bool] = None, lease_s: Optional[float] = None, resume: bool = False,
             payload_kind: str = "tensors") -> SendStream:
        """Open a transfer to which parts are appended as they are produced (e.g. layer by layer)."""
        self._check_priority(priority)
        return SendStream(self, dest, key, priority, deadline_s, self.flow if flow is None else flow, lease_s,
                          resume, payload_kind, self.queue_messages)

    # ------------------------------------------------------------------ receiving
    def recv_stream(self, key: str, timeout_s: Optional[float] = None) -> RecvStream:
        """Parts of transfer ``key`` as they arrive (waits up to ``timeout_s`` for the whole transfer)."""
        call = self._stub.Recv(pb.RecvRequest(key=key, timeout_s=float(timeout_s or 0.0)),
                               metadata=self._metadata(False),
                               timeout=None if not timeout_s else float(timeout_s) + 30.0)
        return RecvStream(call)

    def recv(self, key: str, timeout_s: Optional[float] = None) -> Union[bytes, List[Any]]:
        """The whole transfer ``key``: bytes for a bytes payload, else a list (tensors, bytes parts)."""
        stream = self.recv_stream(key, timeout_s)
        parts = [p.value for p in stream]
        if stream.header is not None and stream.header.payload_kind == "bytes":
            return b"".join(parts)
        return parts

    # ------------------------------------------------------------------ misc
    def stats(self) -> dict:
        try:
            return json.loads(self._stub.Stats(pb.StatsRequest(), metadata=self._metadata(False), timeout=10).json)
        except grpc.RpcError as exc:
            raise KVFlowError.from_rpc(exc) from None

    def wait_ready(self, timeout: float = 10.0) -> None:
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        grpc.channel_ready_future(self._high_channel).result(timeout=timeout)

    def close(self) -> None:
        self._channel.close()
        self._high_channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
