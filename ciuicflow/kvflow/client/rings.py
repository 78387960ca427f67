"""The client's side of the shared-memory rings (proto/shm.py): the pool of rings it keeps for reuse, and
the writer that puts a send's parts into its ring and makes their handles."""
from __future__ import annotations

import os
import threading
import time
from typing import Iterator, Optional

from ..proto import kvflow_pb2 as pb
from ..proto import shm as shmlib


class CallFinished(Exception):
    """The Send call ended (e.g. the sidecar failed the transfer) while its request iterator still ran."""


class RingPool:
    """A client's shared-memory rings (shm.py). When the sidecar takes descriptors (``handoff``, the
    sidecar's descriptor socket), rings are unlinked at once, handed over, and those of finished transfers
    kept, up to ``keep`` of each kind, and reused: a transfer then writes into pages that exist already
    instead of fresh tmpfs pages, which cost about as much to allocate, zero and free as the copy into them.
    Otherwise each transfer has a new, named file with a secret of its own.

    A ring is kept only after its transfer ended well, when the sidecar no longer touches it; a reused send
    ring continues from its last logical position (so a late position written by an old transfer could
    only make the writer wait, never overwrite unread bytes), a reused receive ring starts again at 0 (the
    sidecar's writes start there)."""

    def __init__(self, keep: int):
        self.keep = max(int(keep), 0)
        self.handoff = None       # client.handoff.FdHandoff, once the sidecar is known to take descriptors
        self._closed = False
        self._generations = {}    # handle -> the handoff connection it was registered on
        self._idle = {}           # (kind, size) -> [(fd, handle, pos, handoff generation)]
        self._lock = threading.Lock()

    @property
    def by_fd(self) -> bool:
        return self.handoff is not None

    def take(self, kind: str, size: int) -> "tuple[int, str, int]":
        """A ring of ``size`` data bytes: (fd, its reference for the sidecar, logical position to start at)."""
        handoff = self.handoff
        if handoff is not None and self._idle and not handoff.alive():
            self._drop_idle()           # the sidecar restarted: it knows none of these handles
        with self._lock:
            idle = self._idle.get((kind, size))
            fd, ref, pos, generation = idle.pop() if idle else (-1, "", 0, 0)
        if fd >= 0 and (handoff is None or generation != handoff.generation):
            self._free(fd, ref)
            fd = -1
        if fd >= 0:
            if kind == "r":
                shmlib.publish_read(fd, 0)
                pos = 0
            return fd, ref, pos
        fd, path = shmlib.create_ring(kind, size)
        try:
            if self.handoff is None:
                return fd, shmlib.named_ref(path, shmlib.new_secret(fd)), 0
            shmlib.unlink(path)
            ref = self.handoff.register(fd)
            self._generations[ref] = self.handoff.generation
            return fd, ref, 0
        except BaseException:
            shmlib.unlink(path)
            os.close(fd)
            raise

    def give(self, kind: str, size: int, fd: int, ref: str, pos: int, reusable: bool) -> None:
        """A ring whose transfer has ended (``reusable``: well, and the reader has read up to ``pos``)."""
        if reusable and shmlib.is_handle(ref):
            try:
                reusable = kind == "r" or shmlib.read_position(fd) == pos
            except OSError:
                reusable = False
            with self._lock:
                idle = self._idle.setdefault((kind, size), [])
                if reusable and not self._closed and len(idle) < self.keep:
                    idle.append((fd, ref, pos, self._generations.get(ref, 0)))
                    return
        self._free(fd, ref)

    def _free(self, fd: int, ref: str) -> None:
        if shmlib.is_handle(ref):
            generation = self._generations.pop(ref, 0)
            if self.handoff is not None and generation == self.handoff.generation:
                self.handoff.drop(ref)
        else:
            shmlib.unlink(ref)
        os.close(fd)

    def __del__(self):      # a Client dropped without close(): its idle rings are not kept alive
        try:
            self.close()
        except Exception:   # noqa: BLE001
            pass

    def _drop_idle(self) -> None:
        with self._lock:
            rings = [(fd, ref) for idle in self._idle.values() for fd, ref, *_ in idle]
            self._idle.clear()
        for fd, ref in rings:
            self._free(fd, ref)

    def close(self) -> None:
        """Free the idle rings; rings still in use are freed when their transfers end."""
        with self._lock:
            self._closed = True
        self._drop_idle()


def _succeeded(future) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception() is None


class ShmWriter:
    """The client's side of a shared-memory send: writes the parts into one ring (see shm.py, taken from
    and given back to the client's RingPool) and makes their handles. A ring named by its path is unlinked
    by the sidecar once it has opened it, and here when the transfer ends (whichever comes first), so
    nothing stays in /dev/shm.

    Back-pressure: the sidecar publishes in the file how far it has read, and writing waits while the ring
    (``window`` bytes) has no room (as the in-band stream waits on HTTP/2 flow control), so a sidecar over
    its memory cap or a slow link holds the sender back instead of the bytes piling up in /dev/shm."""

    def __init__(self, window: int, done=lambda: False, rings: Optional[RingPool] = None):
        self.window = max(int(window), 1 << 20)
        self._rings = rings or RingPool(0)
        self.fd, self.path, self.pos = self._rings.take("s", self.window)   # path: the ring's reference
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
                raise CallFinished()
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
