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

On the same host as its sidecar the client hands the bytes over in shared memory (``/dev/shm``, see
``shm.py``): only small handles go over the local gRPC connection. ``Client(..., shm=False)`` turns that off;
the default checks once that the sidecar can open this process's files and otherwise sends the bytes in-band.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Union

import grpc

from ..proto.messages import AUTH_METADATA, FLOW_METADATA, PRIORITY_NAMES, priority_from_pb, priority_to_pb, uninitialized
from ..proto import kvflow_pb2 as pb
from ..proto import kvflow_pb2_grpc as pb_grpc
from ..proto import shm as shmlib

log = logging.getLogger("ciuicflow.kvflow.client")

DEFAULT_MESSAGE_BYTES = 1 << 20      # largest SendData message: a KV layer of up to 1 MiB is one message
BYTES_PART_BYTES = 256 << 10         # a bytes payload is cut into parts of this size
SHM_WINDOW_BYTES = 8 << 20           # shared memory: bytes written ahead of what the sidecar has taken
SHM_RECV_RING_BYTES = 8 << 20        # shared memory: bytes the sidecar writes ahead of what recv has read
SHM_POOL_RINGS = 8                   # shared memory: idle rings kept for reuse, of each kind (send, receive)
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


class _CallFinished(Exception):
    """The Send call ended (e.g. the sidecar failed the transfer) while its request iterator still ran."""


class _RingPool:
    """A client's shared-memory rings (shm.py). When the sidecar opens them by descriptor
    (``by_fd``), rings of finished transfers are kept, up to ``keep`` of each kind, and reused: a
    transfer then writes into pages that exist already instead of fresh tmpfs pages, which cost about as
    much to allocate, zero and free as the copy into them. Otherwise each transfer has a new, named file.

    A ring is kept only after its transfer ended well, when the sidecar no longer touches it; a reused send
    ring continues from its last logical position (so a late position written by an old transfer could
    only make the writer wait, never overwrite unread bytes), a reused receive ring starts again at 0 (the
    sidecar's writes start there)."""

    def __init__(self, keep: int):
        self.keep = max(int(keep), 0)
        self.by_fd = False
        self._closed = False
        self._idle = {}           # (kind, size) -> [(fd, pos)]
        self._lock = threading.Lock()

    def take(self, kind: str, size: int) -> "tuple[int, str, int]":
        """A ring of ``size`` data bytes: (fd, path for the sidecar, logical position to start at)."""
        with self._lock:
            idle = self._idle.get((kind, size))
            fd, pos = idle.pop() if idle else (-1, 0)
        if fd < 0:
            fd, path = shmlib.create_ring(kind, size)
            if not self.by_fd:
                return fd, path, 0
            shmlib.unlink(path)
        elif kind == "r":
            shmlib.publish_read(fd, 0)
            pos = 0
        return fd, shmlib.fd_path(fd), pos

    def give(self, kind: str, size: int, fd: int, path: str, pos: int, reusable: bool) -> None:
        """A ring whose transfer has ended (``reusable``: well, and the reader has read up to ``pos``)."""
        if reusable and self.by_fd and shmlib.is_fd_path(path):
            try:
                reusable = kind == "r" or shmlib.read_position(fd) == pos
            except OSError:
                reusable = False
            with self._lock:
                idle = self._idle.setdefault((kind, size), [])
                if reusable and not self._closed and len(idle) < self.keep:
                    idle.append((fd, pos))
                    return
        shmlib.unlink(path)
        os.close(fd)

    def __del__(self):      # a Client dropped without close(): its idle rings are not kept alive
        try:
            self.close()
        except Exception:   # noqa: BLE001
            pass

    def close(self) -> None:
        """Free the idle rings; rings still in use are freed when their transfers end."""
        with self._lock:
            self._closed = True
            rings = [fd for idle in self._idle.values() for fd, _ in idle]
            self._idle.clear()
        for fd in rings:
            os.close(fd)


def _succeeded(future) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception() is None


class _ShmWriter:
    """The client's side of a shared-memory send: writes the parts into one ring (see shm.py, taken from
    and given back to the client's _RingPool) and makes their handles. A ring named by its path is unlinked
    by the sidecar once it has opened it, and here when the transfer ends (whichever comes first), so
    nothing stays in /dev/shm.

    Back-pressure: the sidecar publishes in the file how far it has read, and writing waits while the ring
    (``window`` bytes) has no room (as the in-band stream waits on HTTP/2 flow control), so a sidecar over
    its memory cap or a slow link holds the sender back instead of the bytes piling up in /dev/shm."""

    def __init__(self, window: int, done=lambda: False, rings: Optional[_RingPool] = None):
        self.window = max(int(window), 1 << 20)
        self._rings = rings or _RingPool(0)
        self.fd, self.path, self.pos = self._rings.take("s", self.window)   # pos: of the next byte written
        self.piece = self.window // 2        # room for two pieces: one being read while the next is written
        self._done = done
        self._lock = threading.Lock()

    def pending(self) -> int:
        """Bytes written and not yet taken by the sidecar (0 once closed)."""
        with self._lock:
            if self.fd < 0:
                return 0
            return self.pos - shmlib.read_position(self.fd)

    def wait_room(self, limit: Optional[int] = None) -> None:
        """Wait until at most ``limit`` (default: the window) bytes are pending."""
        limit = self.window if limit is None else limit
        delay = 0.0005
        while self.pending() > limit:
            if self._done():
                return
            time.sleep(delay)
            delay = min(delay * 2, 0.002)

    def _pieces(self, info: pb.PartInfo, mv: memoryview, resume_at: Optional[int] = None) -> Iterator:
        """Write one part into the ring, piece by piece: the SendData handle of each piece as it is written,
        and None just before waiting for room, so the caller sends the handles it holds first (the sidecar
        only takes what it has been told about). The wait lasts until at most ``resume_at`` bytes (default:
        as much as leaves room for the piece) are pending. An empty part goes in-band."""
        n = mv.nbytes
        if n == 0:
            yield pb.SendData(part=info.index, offset=0, data=b"", info=info)
            return
        for start in range(0, n, self.piece):
            size = min(self.piece, n - start)
            if self.pending() + size > self.window:
                yield None
                self.wait_room(self.window - size if resume_at is None else resume_at)
            yield self._write(info, mv, start, size)

    def _write(self, info: pb.PartInfo, mv: memoryview, start: int, size: int) -> pb.SendData:
        with self._lock:
            if self.fd < 0 or self._done():
                raise _CallFinished()
            pos = self.pos
            shmlib.ring_write(self.fd, self.window, mv[start:start + size], pos)
            self.pos = pos + size
        return pb.SendData(part=info.index, offset=start, info=info if start == 0 else None,
                           shm=pb.ShmRef(path=self.path, offset=pos, length=size, ring_bytes=self.window))

    def messages(self, info: pb.PartInfo, mv: memoryview) -> Iterator[pb.SendRequest]:
        for d in self._pieces(info, mv):
            if d is not None:
                yield pb.SendRequest(data=d)

    def batches(self, parts) -> Iterator[pb.SendRequest]:
        """The parts of a transfer as few messages of handles: a batch goes when it has 256 handles or
        when the ring has no room for the next piece. Writing then resumes once the sidecar has taken half
        the ring, so the next batch again holds several parts (the sidecar packs whole small parts of one
        message into one chunk) instead of trickling one part per message."""
        batch = []
        for info, mv in parts:
            for d in self._pieces(info, mv, resume_at=self.window // 2):
                if d is not None:
                    batch.append(d)
                if batch and (d is None or len(batch) >= 256):
                    yield pb.SendRequest(batch=pb.SendBatch(data=batch))
                    batch = []
        if batch:
            yield pb.SendRequest(batch=pb.SendBatch(data=batch))

    def close(self, future=None):
        """The transfer has ended (``future``: its call, when it ended by itself): the ring goes back to
        the pool if the transfer succeeded."""
        with self._lock:
            if self.fd >= 0:
                self._rings.give("s", self.window, self.fd, self.path, self.pos, _succeeded(future))
                self.fd = -1


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
        self._shm = (_ShmWriter(client.shm_window_bytes, lambda: self.handle.done(), client._rings)
                     if client._use_shm() else None)
        header = pb.SendRequest(header=pb.SendHeader(
            dest=dest, key=key, priority=priority_to_pb(priority), deadline_s=float(deadline_s or 0.0),
            payload_kind=payload_kind, resume=resume, lease_s=float(lease_s or 0.0)))
        try:
            future = client._send_stub(priority).Send.future(self._requests(header), metadata=client._metadata(flow),
                                                             timeout=client._call_timeout(deadline_s))
        except BaseException:
            if self._shm is not None:
                self._shm.close()
            raise
        if self._shm is not None:
            future.add_done_callback(self._shm.close)
        self.handle = SendHandle(future, key, dest)

    def _requests(self, header):
        yield header
        while True:
            item = self._queue.get()
            if item is _END:
                yield pb.SendRequest(end=pb.SendEnd(num_parts=self._parts))
                return
            yield item

    def _finished(self) -> KVFlowError:
        self.handle.wait()      # raises the transfer's error
        return KVFlowError(grpc.StatusCode.FAILED_PRECONDITION, f"transfer {self.key!r} already finished")

    def _put(self, item) -> None:
        while True:
            if self.handle.done():
                raise self._finished()
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
        msgs = self._shm.messages(info, mv) if self._shm is not None else _messages(info, mv, self._message_bytes)
        try:
            for msg in msgs:
                self._put(msg)
        except _CallFinished:
            raise self._finished() from None
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

    def __init__(self, call, shm_file=None, ring: int = 0, rings: Optional[_RingPool] = None):
        self._call = call
        self._shm = shm_file            # (fd, path): this client's ring the sidecar writes chunks into
        self._ring = ring
        self._rings = rings or _RingPool(0)
        self._ended_well = False        # the sidecar ended the stream with OK: it writes no more
        self.header: Optional[RecvHeader] = None
        self._it = self._parts()

    def __iter__(self) -> "RecvStream":
        return self

    def __next__(self) -> Part:
        return next(self._it)

    def cancel(self) -> None:
        self._call.cancel()
        self._close_shm()

    close = cancel

    def _take(self, d, state) -> Optional[Part]:
        """Add one RecvData; the Part it completes, if any."""
        ref = d.shm if d.HasField("shm") else None
        if ref is not None and self._shm is None:
            raise KVFlowError(grpc.StatusCode.DATA_LOSS, "shared-memory chunk without a shared-memory file")
        n = ref.length if ref is not None else len(d.data)
        if d.HasField("info") and d.offset == 0:
            info = state["info"] = d.info
            state["filled"] = 0
            if n == info.nbytes and not info.is_tensor:
                state["buf"] = None          # a part in one chunk: use the message's bytes as they are
                state["info"] = None
                if ref is not None:
                    value = shmlib.ring_read(self._shm[0], self._ring, ref.offset, n)
                    shmlib.publish_read(self._shm[0], ref.offset + n)
                else:
                    value = d.data
                return Part(info.index, value, info.name, info.nbytes, False)
            state["buf"] = uninitialized(info.nbytes)
        info, buf, filled = state["info"], state["buf"], state["filled"]
        if info is None or d.part != info.index or d.offset != filled or filled + n > info.nbytes:
            raise KVFlowError(grpc.StatusCode.DATA_LOSS, f"chunk out of order from the sidecar "
                              f"(part {d.part} offset {d.offset})")
        if ref is not None:
            self._read_ring(ref, memoryview(buf)[filled:filled + n])
        else:
            buf[filled:filled + n] = d.data
        filled = state["filled"] = filled + n
        if filled == info.nbytes:
            state["info"] = None
            state["buf"] = None
            return Part(info.index, decode_part(info, buf), info.name, info.nbytes, info.is_tensor)
        return None

    def _read_ring(self, ref: pb.ShmRef, out: memoryview) -> None:
        shmlib.ring_read_into(self._shm[0], self._ring, out, ref.offset)
        shmlib.publish_read(self._shm[0], ref.offset + ref.length)      # the sidecar may write there again

    def _close_shm(self) -> None:
        f, self._shm = self._shm, None
        if f is not None:
            self._rings.give("r", self._ring, f[0], f[1], 0, self._ended_well)

    def __del__(self):
        try:
            self._close_shm()
        except Exception:   # noqa: BLE001
            pass

    def _parts(self) -> Iterator[Part]:
        state = {"info": None, "buf": None, "filled": 0}
        try:
            for reply in self._call:
                kind = reply.WhichOneof("msg")
                if kind == "header":
                    h = reply.header
                    self.header = RecvHeader(h.key, h.source, h.payload_kind, priority_from_pb(h.priority) or "normal")
                    if self._shm is not None:
                        shmlib.unlink(self._shm[1])     # the sidecar has it open by now: no name left behind
                    continue
                for d in ((reply.data,) if kind == "data" else reply.batch.data):
                    part = self._take(d, state)
                    if part is not None:
                        yield part
            self._ended_well = state["info"] is None
        except grpc.RpcError as exc:
            raise KVFlowError.from_rpc(exc) from None
        except OSError as exc:
            self._call.cancel()
            raise KVFlowError(grpc.StatusCode.DATA_LOSS, f"reading shared memory: {exc}") from None
        finally:
            self._close_shm()


# ---------------------------------------------------------------------- the client
class Client:
    """Talks to the sidecar beside this process (its ``--api`` address).

    ``flow`` (default True) sends metadata ``x-ciuic-flow: enabled`` so transfers are chunk-scheduled and
    congestion-controlled; ``flow=False`` gives the plain FIFO baseline. ``token``: the sidecar's
    ``--api-token`` if it has one. ``shm``: hand the bytes over in shared memory (/dev/shm) when the sidecar
    can open this process's files (None, the default: check once and fall back to in-band bytes; False:
    always in-band; True: fail if the sidecar cannot). ``shm_window_bytes`` and ``shm_recv_ring_bytes``:
    the sizes of a transfer's shared-memory ring when sending and receiving (see shm.py).
    """

    def __init__(self, address: str, *, flow: bool = True, token: Optional[str] = None,
                 message_bytes: int = DEFAULT_MESSAGE_BYTES, queue_messages: int = 8, shm: Optional[bool] = None,
                 shm_window_bytes: int = SHM_WINDOW_BYTES, shm_recv_ring_bytes: int = SHM_RECV_RING_BYTES,
                 shm_pool_rings: int = SHM_POOL_RINGS):
        self.address = address
        self._rings = _RingPool(shm_pool_rings)
        self.shm = shm
        self.shm_window_bytes = int(shm_window_bytes)
        self.shm_recv_ring_bytes = max(int(shm_recv_ring_bytes), 1 << 20)
        self._shm_ok: Optional[bool] = None if shm is not False else False
        self._shm_lock = threading.Lock()
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

    def _use_shm(self) -> bool:
        """Whether the bytes go in shared memory (checked once with ShmProbe)."""
        if self._shm_ok is None:
            with self._shm_lock:
                if self._shm_ok is None:
                    ok, why = self._probe_shm()
                    if not ok and self.shm:
                        raise KVFlowError(grpc.StatusCode.FAILED_PRECONDITION,
                                          f"shared memory with the sidecar is not possible: {why}")
                    self._shm_ok = ok
        return self._shm_ok

    def _probe_shm(self):
        """Whether the sidecar can open and write this process's shared-memory files: first named by
        descriptor (then rings are reused, see _RingPool), else by name; (ok, why not)."""
        if not shmlib.available():
            return False, f"{shmlib.shm_dir()} is not writable"
        ok, why = self._probe_shm_file(by_fd=True)
        self._rings.by_fd = ok
        if not ok:
            log.debug("shared memory by descriptor not possible (%s); trying by name", why)
            ok, why = self._probe_shm_file(by_fd=False)
        return ok, why

    def _probe_shm_file(self, by_fd: bool):
        try:
            fd, path = shmlib.create("p")
        except OSError as exc:
            return False, str(exc)
        try:
            if by_fd:
                shmlib.unlink(path)
                path = shmlib.fd_path(fd)
            nonce = os.urandom(16)
            shmlib.write_all(fd, nonce + bytes(2 * shmlib.PAGE - len(nonce)), 0)
            reply = self._stub.ShmProbe(pb.ShmProbeRequest(path=path, nonce=nonce), metadata=self._metadata(False),
                                        timeout=30)
            if reply.ok and os.pread(fd, len(nonce), shmlib.PAGE) != nonce:
                # the rings need the sidecar to write into this process's files
                return False, "the sidecar cannot write into the shared-memory file"
            return reply.ok, reply.message
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED,):
                return False, "the sidecar does not support shared memory"
            raise KVFlowError.from_rpc(exc) from None
        finally:
            shmlib.unlink(path)
            os.close(fd)

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
        box = []
        writer = (_ShmWriter(self.shm_window_bytes, lambda: bool(box) and box[0].done(), self._rings)
                  if self._use_shm() else None)

        def requests():
            yield header
            if writer is not None:
                try:
                    yield from writer.batches(parts)
                except _CallFinished:
                    return      # the sidecar already ended the call: its status is the handle's outcome
            else:
                for info, mv in parts:
                    yield from _messages(info, mv, message_bytes)
            yield pb.SendRequest(end=pb.SendEnd(num_parts=len(parts)))

        try:
            future = self._send_stub(priority).Send.future(requests(), metadata=self._metadata(flow),
                                                           timeout=self._call_timeout(deadline_s))
        except BaseException:
            if writer is not None:
                writer.close()
            raise
        if writer is not None:
            box.append(future)
            future.add_done_callback(writer.close)
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
        ring = self.shm_recv_ring_bytes
        shm_file = self._rings.take("r", ring)[:2] if self._use_shm() else None
        try:
            call = self._stub.Recv(pb.RecvRequest(key=key, timeout_s=float(timeout_s or 0.0),
                                                  shm_path=shm_file[1] if shm_file else "",
                                                  shm_ring_bytes=ring if shm_file else 0),
                                   metadata=self._metadata(False),
                                   timeout=None if not timeout_s else float(timeout_s) + 30.0)
        except BaseException:
            if shm_file is not None:
                self._rings.give("r", ring, shm_file[0], shm_file[1], 0, False)
            raise
        return RecvStream(call, shm_file, ring, self._rings)

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
        """Wait until both connections to the sidecar are up (and check shared memory once)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)
        grpc.channel_ready_future(self._high_channel).result(timeout=timeout)
        self._use_shm()

    def close(self) -> None:
        self._channel.close()
        self._high_channel.close()
        self._rings.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
