"""Chunks: how large they are on a path (``chunk_bytes``), and cutting a Send's messages into them
(``Cutter``). Pure logic."""
from __future__ import annotations

from typing import List, Optional

import crc32c
import grpc

from ..proto import kvflow_pb2 as pb
from ..proto.messages import check_part_info
from .transfer import OutChunk, TransferFailed

PACK_S = 0.02                   # a chunk takes at most this long on the path (see chunk_bytes)
SLOW_CHUNK_S = 0.05             # on a slow path, chunks are halved until one takes at most this long ...
MIN_CHUNK = 32 << 10            # ... but not below this (nor below --chunk-size)


def chunk_bytes(btl_bw: float, chunk_size: int, limit: int) -> int:
    """Chunk size on a path of bandwidth ``btl_bw`` (bytes/s, 0: not measured yet): ``chunk_size`` doubled
    while the path carries the result in PACK_S, so a high-priority chunk never waits longer than that
    behind one, and at most ``limit``; on a fast path the per-chunk work of both sidecars and both clients
    (a checksum, a frame, an ack, a scheduling decision, the handles) falls with each doubling. On a slow
    path chunks are halved while one holds the path longer than SLOW_CHUNK_S (down to MIN_CHUNK): a
    256 KiB chunk is 105 ms of a 20 Mbit/s link, 420 ms of a 5 Mbit/s one, which a high-priority chunk
    would wait behind, and the window (two chunks at least) grows with it. Doubling and halving keep chunk
    boundaries on the pieces a client writes into its shared-memory window."""
    size = chunk_size
    while btl_bw > 0 and size * 2 <= min(limit, btl_bw * PACK_S):
        size *= 2
    while btl_bw > 0 and size > btl_bw * SLOW_CHUNK_S and size // 2 >= MIN_CHUNK:
        size //= 2
    return size


class Cutter:
    """Cuts the local client's messages of one transfer into chunks of at most ``chunk_size`` bytes,
    checking that parts come in order and match their description."""

    def __init__(self, chunk_size: int, whole_part_bytes: int = 0):
        self.configured_chunk = chunk_size
        self.base_chunk = chunk_size  # the peer's chunk size now (set_peer_chunk), for parts that start from now on
        self.chunk_size = chunk_size  # the current part's
        # A part no larger than this goes as one chunk (no short tail chunk with its own ack): KV layers
        # are often a little over a chunk (e.g. 288 KiB), and cutting them in 256 KiB + 32 KiB doubles the
        # per-chunk cost for no gain in preemption.
        self.min_whole_bytes = max(int(whole_part_bytes), chunk_size)
        self.whole_part_bytes = self.min_whole_bytes
        self.part = 0                 # the part being filled
        self.offset = 0               # bytes of it received
        self.nbytes: Optional[int] = None
        self.info: Optional[pb.PartInfo] = None
        self.buf = bytearray()
        self.buf_offset = 0           # part offset of buf[0]

    def set_peer_chunk(self, size: int) -> None:
        """The chunk size to the peer now (``chunk_bytes``): parts that start from now on are cut at it, and
        whole parts may be as large. On a slow path (chunks below --chunk-size) parts are cut at the chunk
        size: a whole 1 MiB layer would hold a 20 Mbit/s link for 420 ms, high-priority chunks behind it."""
        self.base_chunk = size
        self.whole_part_bytes = max(self.min_whole_bytes, size) if size >= self.configured_chunk else size

    def feed(self, d: pb.SendData) -> List[OutChunk]:
        self.check(d.part, d.offset, d.info if d.HasField("info") else None, len(d.data))
        return self.feed_bytes(d.data)

    def check(self, part: int, offset: int, info: Optional[pb.PartInfo], n: int) -> None:
        """Validate the next message (part, offset, PartInfo on a part's first message, n bytes)."""
        if self.nbytes is None:       # a new part starts
            if part != self.part or offset != 0:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"chunk out of order: got part {part} offset {offset}, "
                                     f"expected part {self.part} offset 0")
            if info is None:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"first message of part {part} has no PartInfo")
            err = check_part_info(info, self.part)
            if err:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, err)
            self.nbytes = info.nbytes
            self.info = info
            self.chunk_size = self.nbytes if 0 < self.nbytes <= self.whole_part_bytes else self.base_chunk
        elif part != self.part or offset != self.offset:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"chunk out of order: got part {part} offset {offset}, "
                                 f"expected part {self.part} offset {self.offset}")
        if self.offset + n > self.nbytes:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"part {self.part}: {self.offset + n} bytes sent, part has {self.nbytes}")

    @property
    def piece_bytes(self) -> int:
        """How much of a shared-memory part to read at once: one chunk (whole parts stay whole)."""
        return self.chunk_size

    def feed_bytes(self, data: bytes) -> List[OutChunk]:
        """The bytes of the message just checked (possibly a piece of it: then check() the rest again)."""
        self.offset += len(data)
        out = []
        pos = 0
        if self.buf:
            need = self.chunk_size - len(self.buf)
            self.buf += data[:need]
            pos = min(need, len(data))
            if len(self.buf) == self.chunk_size:
                out.append(self._emit(bytes(self.buf)))
                self.buf = bytearray()
        # Whole chunks straight from the message (no copy when the message is exactly one chunk).
        while len(data) - pos >= self.chunk_size:
            piece = data if pos == 0 and len(data) == self.chunk_size else data[pos:pos + self.chunk_size]
            out.append(self._emit(piece))
            pos += self.chunk_size
        if pos < len(data):
            self.buf += data[pos:]
        if self.offset == self.nbytes:
            if self.buf or not out:
                out.append(self._emit(bytes(self.buf)))
                self.buf = bytearray()
            self.part += 1
            self.offset = 0
            self.nbytes = None
            self.buf_offset = 0
        return out

    def packable(self, d: pb.SendData) -> int:
        """Bytes of ``d`` when it is a whole part in shared memory, at a part boundary, that may share a
        chunk with its neighbours (0 otherwise)."""
        if (self.nbytes is not None or d.offset or d.data or not d.HasField("info")
                or not d.HasField("shm") or d.shm.length != d.info.nbytes):
            return 0
        return d.shm.length if 0 < d.shm.length <= self.whole_part_bytes else 0

    def take_whole(self, d: pb.SendData) -> None:
        """Check ``d`` (a packable part) and count it as sent whole, in a packed chunk."""
        self.check(d.part, d.offset, d.info, d.shm.length)
        self.part += 1
        self.offset = 0
        self.nbytes = None

    def _emit(self, data: bytes) -> OutChunk:
        info = self.info if self.buf_offset == 0 else None
        chunk = OutChunk(self.part, self.buf_offset, data, crc32c.crc32c(data), info)
        self.buf_offset += len(data)
        return chunk

    def finish(self, num_parts: int) -> None:
        if self.nbytes is not None:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"SendEnd before part {self.part} was complete ({self.offset} of {self.nbytes} bytes)")
        if num_parts != self.part:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"SendEnd says {num_parts} parts, {self.part} were sent")
