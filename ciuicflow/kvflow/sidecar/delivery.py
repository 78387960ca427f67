"""Delivery: a received transfer's chunks streamed to the local client's ``Recv`` as they arrive, written
into the client's shared-memory ring (handles in the messages) or in the messages themselves."""
from __future__ import annotations

import asyncio
import os
import time
from typing import List, Optional

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto import shm as shmlib
from ..proto.messages import priority_to_pb
from .store import InTransfer, Store

RING_POLL_S = 0.0005     # Recv into a full ring: first wait for the client to read (doubling up to 10x)


class RecvRing:
    """The sidecar's side of a receiving client's ring (proto/shm.py): writes chunks into it, never more
    than the ring ahead of what the client has read."""

    def __init__(self, fd: int, ring: int):
        self.fd, self.ring = fd, int(ring)
        self.pos = 0              # logical position of the next byte written
        self.read = 0             # how far the client has read, as last seen

    def _room(self, n: int) -> bool:
        if self.pos + n - self.read <= self.ring:
            return True
        self.read = min(shmlib.read_position(self.fd), self.pos)
        return self.pos + n - self.read <= self.ring

    def batch(self, chunks, pos: int):
        """RecvData handles for ``chunks[pos:]``, as far as they fit (at most 1024 parts); the next pos.
        A chunk larger than the whole ring goes in-band."""
        out = []
        while pos < len(chunks) and len(out) < 1024:
            c = chunks[pos]
            n = len(c.data)
            in_ring = 0 < n <= self.ring
            if in_ring and not self._room(n):
                break
            pos += 1
            if not in_ring:
                out += in_band(c)
                continue
            shmlib.ring_write(self.fd, self.ring, c.data, self.pos)
            for part, offset, info, start, length in c.spans():
                ref = pb.ShmRef(offset=self.pos + start, length=length) if length else None
                out.append(pb.RecvData(part=part, offset=offset, info=info, shm=ref))
            self.pos += n
        return out, pos


def in_band(c) -> List[pb.RecvData]:
    """The parts of chunk ``c`` with their bytes in the messages themselves."""
    return [pb.RecvData(part=part, offset=offset, info=info, data=bytes(c.data[start:start + length]))
            for part, offset, info, start, length in c.spans()]


async def deliver(entry: InTransfer, store: Store, ring: Optional[RecvRing], deadline: Optional[float],
                  timeout_s: float, shutting_down, context, manual_ack: bool = False):
    """The RecvReply messages of ``entry`` (header first), until it is complete and collected (at-most-once),
    or, with ``manual_ack``, delivered and kept until the consumer's Acknowledge (at-least-once); ends the
    call (``context.abort``) with the transfer's failure, at the deadline, or at shutdown. ``ring``: the
    client's shared-memory ring (None: in-band). The store's sweep ends a call that stops reading for the
    transfer's lease (Store.end_readers), and the client is told why at once."""
    task = asyncio.current_task()
    entry.start_reading(task)
    try:
        async for reply in _replies(entry, store, ring, deadline, timeout_s, shutting_down, context, manual_ack):
            yield reply
    except asyncio.CancelledError:
        ended = entry.ended_with(task)
        if ended is None:
            raise               # the client went away, or the server stops
        await context.abort(*ended)
    finally:
        if ring is not None:
            os.close(ring.fd)
        entry.stop_reading(task)


async def _replies(entry: InTransfer, store: Store, ring: Optional[RecvRing], deadline: Optional[float],
                   timeout_s: float, shutting_down, context, manual_ack: bool):
    """deliver's messages (see there)."""
    yield pb.RecvReply(header=pb.RecvHeader(key=entry.key, source=entry.source,
                                            payload_kind=entry.payload_kind,
                                            priority=priority_to_pb(entry.priority)))
    pos = 0
    generation = entry.generation
    ring_wait = RING_POLL_S
    while True:
        if entry.generation != generation:
            if any(g > generation and seq < pos for g, seq in entry.truncations):
                await context.abort(grpc.StatusCode.ABORTED,
                                    f"transfer {entry.key!r} was resumed with different content; "
                                    "receive it again")
            generation = entry.generation
        ring_full = False
        if ring is not None and pos < len(entry.chunks):
            # Shared memory: the chunks that arrived so far (as many as the ring has room for) go
            # in one message of handles.
            try:
                batch, pos = ring.batch(entry.chunks, pos)
            except OSError as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"writing shared memory for {entry.key!r}: {exc}")
            if batch:
                ring_wait = RING_POLL_S
                yield pb.RecvReply(batch=pb.RecvBatch(data=batch))
                entry.read_progress()
                continue
            ring_full = True
        while ring is None and pos < len(entry.chunks):
            c = entry.chunks[pos]
            pos += 1
            for d in in_band(c):
                yield pb.RecvReply(data=d)
            entry.read_progress()
        if entry.failed:
            code, message = entry.failed
            await context.abort(code, message)
        if entry.complete and pos >= len(entry.chunks):
            if manual_ack:
                entry.mark_delivered()      # kept (and delivered again) until Acknowledge or its lease
            else:
                store.collect(entry)
            return
        if shutting_down():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down")
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"transfer {entry.key!r} incomplete after {timeout_s:g}s "
                                f"({len(entry.chunks)} chunks arrived)")
        if ring_full:       # wait for the client to read (it says so only in the ring's header)
            await asyncio.sleep(ring_wait)
            ring_wait = min(2 * ring_wait, 10 * RING_POLL_S)
        else:
            await entry.changed(1.0 if timeout is None else min(timeout, 1.0))
