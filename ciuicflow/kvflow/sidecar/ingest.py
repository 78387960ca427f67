"""Ingest: a local ``Send``'s messages (bytes in-band, or handles to the client's shared-memory ring) cut
into chunks of the peer's current chunk size and handed to the peer sender, each once memory for
it is admitted (the memory budget, waiting up to the admission timeout) and the transfer's read-ahead
allows (a normal/low flow transfer waits while enough of it is unsent)."""
from __future__ import annotations

import os
from typing import Dict, Optional

import crc32c
import grpc

from ..core.chunking import Cutter
from ..core.limits import chunk_cost
from ..core.transfer import OutChunk, Transfer, TransferFailed
from ..proto import kvflow_pb2 as pb
from ..proto import shm as shmlib
from ..proto.codec import MALFORMED, uninitialized
from ..proto.messages import MAX_PACKED_PARTS
from .shm_access import ShmRefused

MAX_SHM_FILES = 16      # shared-memory files one Send may name


class Ingest:
    """``chunk_size`` (--chunk-size) grows with the peer's bandwidth up to ``chunk_limit``; parts up to
    ``whole_part_bytes`` stay whole; ``readahead`` (--ingest-readahead); memory from ``budget``;
    ``local_shm``: whether handles to shared memory are accepted."""

    def __init__(self, budget, *, chunk_size: int, whole_part_bytes: int, chunk_limit: int, readahead: int,
                 admission_timeout_s: float, local_shm: bool, access=None):
        self.budget = budget
        self.chunk_size = chunk_size
        self.whole_part_bytes = whole_part_bytes
        self.chunk_limit = chunk_limit
        self.readahead = readahead
        self.admission_timeout_s = admission_timeout_s
        self.local_shm = local_shm
        self.access = access            # shm_access.ShmAccess: which of the caller's files may be opened

    def _open_shm(self, files: Dict[str, int], path: str) -> int:
        fd = files.get(path)
        if fd is None:
            if not self.local_shm:
                raise TransferFailed(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is off (--no-local-shm)")
            if len(files) >= MAX_SHM_FILES:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "too many shared-memory files in one Send")
            try:
                fd = self.access.open(path)     # read-write: to say what it has read
            except ShmRefused as exc:
                raise TransferFailed(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            files[path] = fd
            self.access.unlink(path, fd)        # both sides hold it open: no name left behind if either dies
        return fd

    async def run(self, sender, t: Transfer, requests) -> None:
        """Read the rest of a Send (``requests``, after its header) into ``t``'s chunks for ``sender``;
        raises TransferFailed for what the local client got wrong."""
        files: Dict[str, int] = {}
        try:
            await self._read(sender, t, requests, files)
        finally:
            for fd in files.values():
                os.close(fd)

    def _shm_chunks(self, cutter: Cutter, d: pb.SendData, files: Dict[str, int]):
        """Chunks of a shared-memory SendData, read one chunk at a time (after the readahead wait of the
        previous one, so memory caps and ingest back-pressure work as for in-band bytes)."""
        ref = d.shm
        if d.data:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "SendData with both data and shm")
        cutter.check(d.part, d.offset, d.info if d.HasField("info") else None, ref.length)
        fd = self._open_shm(files, ref.path)
        pos, end = ref.offset, ref.offset + ref.length
        while pos < end:
            n = min(cutter.piece_bytes, end - pos)
            data = self._read_ring(fd, ref, pos, n)
            pos += n
            yield from cutter.feed_bytes(data)

    @staticmethod
    def _read_ring(fd: int, ref: pb.ShmRef, pos: int, n: int, into: Optional[memoryview] = None):
        """``n`` bytes at logical position ``pos`` of the client's ring (into ``into`` when given); the
        client may then write there again."""
        try:
            if into is None:
                data = shmlib.ring_read(fd, ref.ring_bytes, pos, n)
            else:
                shmlib.ring_read_into(fd, ref.ring_bytes, into, pos)
                data = into
            shmlib.publish_read(fd, pos + n)
        except (OSError, EOFError, ValueError) as exc:
            raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, f"reading shared memory: {exc}") from None
        return data

    def _packed_chunk(self, cutter: Cutter, group, files: Dict[str, int]) -> OutChunk:
        """Whole small parts from shared memory read into one chunk: one checksum, one frame and one ack
        for all of them instead of each (for small layers the per-chunk work of both sidecars and both
        clients is much of a transfer's CPU; docs/kvflow.md, Packed chunks)."""
        first = cutter.part
        buf = uninitialized(sum(d.shm.length for d in group))
        view = memoryview(buf)
        pos = 0
        for d in group:
            cutter.take_whole(d)
            n = d.shm.length
            self._read_ring(self._open_shm(files, d.shm.path), d.shm, d.shm.offset, n, view[pos:pos + n])
            pos += n
        infos = [d.info for d in group]
        return OutChunk(first, 0, buf, crc32c.crc32c(buf), infos[0], tuple(infos[1:]))

    def _batch_chunks(self, cutter: Cutter, datas, files: Dict[str, int], pack_bytes: int):
        """The chunks of one message's SendData items, in order; runs of whole small parts in shared memory
        are packed (up to ``pack_bytes`` and MAX_PACKED_PARTS per chunk)."""
        i = 0
        while i < len(datas):
            group, total = [], 0
            while i + len(group) < len(datas) and len(group) < MAX_PACKED_PARTS:
                n = cutter.packable(datas[i + len(group)])
                if not n or total + n > pack_bytes:
                    break
                group.append(datas[i + len(group)])
                total += n
            if len(group) > 1:
                i += len(group)
                yield self._packed_chunk(cutter, group, files)
                continue
            d = datas[i]
            i += 1
            yield from (self._shm_chunks(cutter, d, files) if d.HasField("shm") else cutter.feed(d))

    async def _read(self, sender, t: Transfer, requests, files: Dict[str, int]) -> None:
        cutter = Cutter(self.chunk_size, self.whole_part_bytes)
        async for req in requests:
            if t.finished:
                return
            if req is MALFORMED:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "malformed SendRequest")
            kind = req.WhichOneof("msg")
            if kind == "data" or kind == "batch":
                datas = (req.data,) if kind == "data" else req.batch.data
            else:
                datas = ()
            if datas:
                peer_chunk = sender.chunk_bytes(self.chunk_size, self.chunk_limit)   # also the packing limit
                cutter.set_peer_chunk(peer_chunk)
                for chunk in self._batch_chunks(cutter, datas, files, peer_chunk):
                    await sender.wait_readahead(t, self.readahead)
                    chunk.cost = chunk_cost(len(chunk.data), (chunk.info, *chunk.more))   # descriptions count
                    if t.finished or not await self._admit(sender, t, chunk.cost):
                        return
                    sender.add_chunk(t, chunk)
                continue
            if kind == "end":
                cutter.finish(req.end.num_parts)
                sender.close_transfer(t, req.end.num_parts)
                return
            elif kind == "header":
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "a second SendHeader in one Send")
            else:
                raise TransferFailed(grpc.StatusCode.INVALID_ARGUMENT, "empty SendRequest")
        raise TransferFailed(grpc.StatusCode.CANCELLED, "the Send stream ended without SendEnd")

    async def _admit(self, sender, t: Transfer, n: int) -> bool:
        """Reserve memory for a chunk of ``n`` bytes of ``t``, waiting up to the admission timeout (False:
        the transfer finished meanwhile); raises RESOURCE_EXHAUSTED when it cannot fit."""
        budget = self.budget
        too_big = t.buffered + n > min(budget.peer_cap, budget.total_cap)
        # Whether the peer spools decides what fits: learnt from the handshake (the sender says when). If
        # ``t`` fails meanwhile, the local API cancels this ingest.
        if too_big and not await sender.peer_durable(self.admission_timeout_s):
            # Kept until the peer commits it (to resend after a restart of the peer), so it can never
            # fit: refuse now rather than after the admission timeout.
            raise TransferFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"transfer {t.key!r} is larger than the memory cap ({budget.peer_cap} bytes "
                                 f"per peer; a receiver with --spool-dir lifts this)")
        if not await budget.reserve(sender.name, n, self.admission_timeout_s):
            raise TransferFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"over the memory cap for {self.admission_timeout_s:g}s (peer {sender.name!r}: "
                                 f"{budget.per_peer.get(sender.name, 0)} bytes buffered, total {budget.used})")
        if t.finished:
            budget.release(sender.name, n)
            return False
        t.reserved(n)
        return True
