"""A transfer in progress, seen from the client: ``SendHandle`` (its outcome), ``SendStream`` (parts
appended as they are produced) and ``RecvStream`` (parts as they arrive)."""
from __future__ import annotations

import queue
from typing import Iterable, Iterator, Optional

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto import shm as shmlib
from ..proto.codec import uninitialized
from ..proto.messages import priority_from_pb, priority_to_pb
from .payload import KVFlowError, Part, RecvHeader, SendResult, decode_part, encode_part, messages
from .rings import CallFinished, RingPool

_END = object()
GROW_MIN = 8 << 20      # a part's buffer starts at most this large (or its first chunk), then doubles


class _PartBuffer:
    """A received part's bytes as they arrive. The size its description declares comes from the sending
    peer: room is made for what has arrived (doubling from GROW_MIN, never past the declared size), not
    for what was declared (one byte declaring a TiB allocates 8 MiB, not a TiB). A part of up to GROW_MIN
    gets its buffer at once, as before."""

    def __init__(self, nbytes: int, first: int):
        self.nbytes = nbytes
        self.buf = uninitialized(min(nbytes, max(GROW_MIN, first)))
        self.filled = 0

    def room(self, n: int) -> memoryview:
        """Where the next ``n`` bytes go (the caller fills all of it)."""
        need = self.filled + n
        if need > len(self.buf):
            bigger = uninitialized(min(self.nbytes, max(need, 2 * len(self.buf))))
            memoryview(bigger)[:self.filled] = memoryview(self.buf)[:self.filled]
            self.buf = bigger
        view = memoryview(self.buf)[self.filled:need]
        self.filled = need
        return view


class SendHandle:
    """A transfer in progress. ``wait()`` returns a SendResult once the destination sidecar holds all of it."""

    def __init__(self, future, key: str, dest: str):
        self._future = future
        self.key = key
        self.dest = dest

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn) -> None:
        """Call ``fn(future)`` once the transfer has ended (at once if it has)."""
        self._future.add_done_callback(fn)

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

    def __init__(self, client, dest: str, key: str, priority: str, deadline_s, flow: bool,
                 lease_s, resume: bool, payload_kind: str, queue_messages: int, idempotency_key=None):
        self.dest = dest
        self.key = key
        self._message_bytes = client.message_bytes
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, queue_messages))
        self._parts = 0
        self._closed = False
        self._shm = client._send_ring(lambda: self.handle.done())
        header = pb.SendRequest(header=pb.SendHeader(
            dest=dest, key=key, priority=priority_to_pb(priority), deadline_s=float(deadline_s or 0.0),
            payload_kind=payload_kind, resume=resume, lease_s=float(lease_s or 0.0),
            idempotency_key=idempotency_key or ""))
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
        msgs = self._shm.messages(info, mv) if self._shm is not None else messages(info, mv, self._message_bytes)
        try:
            for msg in msgs:
                self._put(msg)
        except CallFinished:
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

    def __init__(self, call, shm_file=None, ring: int = 0, rings: Optional[RingPool] = None):
        self._call = call
        self._shm = shm_file            # (fd, path): this client's ring the sidecar writes chunks into
        self._ring = ring
        self._rings = rings or RingPool(0)
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
            state["buf"] = _PartBuffer(info.nbytes, n)
        info, buf, filled = state["info"], state["buf"], state["filled"]
        if info is None or d.part != info.index or d.offset != filled or filled + n > info.nbytes:
            raise KVFlowError(grpc.StatusCode.DATA_LOSS, f"chunk out of order from the sidecar "
                              f"(part {d.part} offset {d.offset})")
        if ref is not None:
            self._read_ring(ref, buf.room(n))
        else:
            buf.room(n)[:] = d.data
        filled = state["filled"] = filled + n
        if filled == info.nbytes:
            state["info"] = None
            state["buf"] = None
            return Part(info.index, decode_part(info, buf.buf), info.name, info.nbytes, info.is_tensor)
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
