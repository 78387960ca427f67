"""The TCP data plane's receiving side (framing and the sending side: tcp.py): ``DataPlaneServer`` hands
each connection's frames to ``PeerService.serve`` like ``Link``'s.

Nothing a stranger sends makes it hold more than a few bytes: until its hello (a ticket, at most
``MAX_HELLO`` bytes) checks out, a connection's only frame may be that hello, so no frame header makes it
allocate a payload; connections are limited (``max_connections`` in all, those beyond refused before
anything is made for them: listener.py; ``max_unauthenticated`` before their hello), a hello must come
within ``hello_timeout_s`` and an authenticated stream that sends nothing for ``idle_timeout_s`` is
closed (its sender reconnects when it has work). Frames read but not yet handled are bounded in bytes,
then the socket is not read (TCP flow control holds the sender).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import grpc

from ..core.limits import Tickets
from ..proto.codec import parse_chunk_frame, uninitialized
from .listener import BoundedListener
from .tcp import HEAD, HELLO, MSG, STATUS, _status_payload, _tune

log = logging.getLogger("ciuicflow.kvflow.tcp")

MAX_HELLO = 64              # bytes: a ticket (24) and room to spare
QUEUE_HIGH = 16             # frames read but not yet handled: stop reading from the socket above this ...
QUEUE_BYTES_MIN = 8 << 20   # ... or above max(this, twice the largest frame) bytes
LINGER_S = 1.0              # after the status: how long what the sender still sends is read and dropped ...
LINGER_BYTES = 1 << 20      # ... and at most how much
_TOO_MANY = _status_payload(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many data plane connections")
TOO_MANY = HEAD.pack(STATUS, len(_TOO_MANY)) + _TOO_MANY


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """What ``PeerService.serve`` needs of a gRPC servicer context."""

    async def abort(self, code: grpc.StatusCode, message: str):
        raise _Abort(code, message)


class _EOF:
    pass


class _Connection(asyncio.BufferedProtocol):
    """One sender's connection: frames are read straight into their own buffers, handed to the peer
    service in order, and its replies written back."""

    def __init__(self, plane: "DataPlaneServer"):
        self.plane = plane
        self.transport = None
        self.frames: asyncio.Queue = asyncio.Queue()
        self.queued = 0             # bytes of the frames in ``frames``
        self.head = bytearray(HEAD.size)
        self.payload = None
        self.buf = memoryview(self.head)
        self.filled = 0
        self.kind = None
        self.authenticated = False
        self.counted = False        # in the plane's count of connections without a hello yet
        self.paused = False
        self.discarded = -1         # >= 0: the stream has ended, bytes read since are dropped (linger)
        self.eof = asyncio.Event()
        self.writable = asyncio.Event()
        self.writable.set()
        self.task = None

    # --- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        plane = self.plane
        plane.connections.add(self)
        if plane.unauthenticated >= plane.max_unauthenticated:
            plane.rejected(grpc.StatusCode.RESOURCE_EXHAUSTED)
            transport.write(TOO_MANY)
            transport.close()
            return
        _tune(transport.get_extra_info("socket"))
        plane.unauthenticated += 1
        self.counted = True
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def get_buffer(self, sizehint: int):
        return self.buf[self.filled:]

    def _refuse(self, code: grpc.StatusCode, message: str) -> None:
        self.frames.put_nowait(_Abort(code, message))
        self.transport.pause_reading()
        self.buf, self.filled = memoryview(bytearray(HEAD.size)), 0    # whatever still comes is dropped

    def buffer_updated(self, nbytes: int) -> None:
        if self.discarded >= 0:
            self.discarded += nbytes
            self.filled = 0
            if self.discarded > LINGER_BYTES:
                self.transport.abort()
            return
        self.filled += nbytes
        if self.filled < len(self.buf):
            return
        if self.kind is None:
            kind, n = HEAD.unpack(self.head)
            if not self.authenticated and (kind != HELLO or n > MAX_HELLO):
                # before the hello, no header makes this side allocate anything
                self.plane.rejected(grpc.StatusCode.UNAUTHENTICATED)
                return self._refuse(grpc.StatusCode.UNAUTHENTICATED,
                                    "data plane needs a valid ticket (from KVFlowPeer.DataPlane) first, once")
            if n > self.plane.max_frame_bytes:
                return self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"frame of {n} bytes over the limit of {self.plane.max_frame_bytes}")
            self.payload = uninitialized(n)
            self.kind, self.buf, self.filled = kind, memoryview(self.payload), 0
            if n:
                return
        self.frames.put_nowait((self.kind, self.payload))
        self.queued += len(self.payload)
        self.kind, self.buf, self.filled = None, memoryview(self.head), 0
        if not self.authenticated:
            self.transport.pause_reading()      # nothing more until the hello is checked
            self.paused = True
        elif not self.paused and (self.frames.qsize() >= QUEUE_HIGH or self.queued >= self.plane.queue_bytes):
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self):
        self.frames.put_nowait(_EOF)
        self.eof.set()
        return True         # keep our side open: the status still goes back

    def connection_lost(self, exc) -> None:
        log.debug("data plane connection from %s closed (%s)", self.transport.get_extra_info("peername"), exc)
        self.frames.put_nowait(_EOF)
        self.eof.set()
        self.writable.set()
        self._uncount()
        if self in self.plane.connections:
            self.plane.connections.discard(self)
            self.plane.listener.release()

    def _uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.plane.unauthenticated -= 1

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # --- the stream
    async def _next(self, timeout: Optional[float]):
        try:
            item = await asyncio.wait_for(self.frames.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, tuple):
            self.queued -= len(item[1])
        if self.paused and self.authenticated and self.frames.qsize() < QUEUE_HIGH // 2 \
                and self.queued < self.plane.queue_bytes // 2 and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()
        if isinstance(item, _Abort):
            raise item
        return item

    async def _requests(self):
        while True:
            item = await self._next(self.plane.idle_timeout_s)
            if item is None:
                raise _Abort(grpc.StatusCode.UNAVAILABLE,
                             f"data plane stream idle for {self.plane.idle_timeout_s:g}s: closed")
            if item is _EOF:
                return
            kind, payload = item
            if kind != MSG:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {kind} on the data plane")
            yield parse_chunk_frame(payload) or self.plane.parse(payload)

    def _send(self, kind: int, payload: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(HEAD.pack(kind, len(payload)) + payload)

    async def _hello(self) -> Optional[str]:
        """The sender named by this connection's ticket (None: it closed without a hello)."""
        item = await self._next(self.plane.hello_timeout_s)
        if item is None:
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no hello on the data plane")
        if item is _EOF:
            return None
        kind, payload = item
        source = self.plane.tickets.redeem(payload) if kind == HELLO else None
        if source is None:
            self.plane.rejected(grpc.StatusCode.UNAUTHENTICATED)
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                         "data plane needs a valid ticket (from KVFlowPeer.DataPlane), once")
        self.authenticated = True
        self._uncount()
        self.paused = False
        self.transport.resume_reading()
        return source

    async def _serve(self) -> None:
        code, message = grpc.StatusCode.OK, ""
        try:
            source = await self._hello()
            if source is None:
                return
            async for reply in self.plane.serve(source, self._requests(), _Context()):
                self._send(MSG, reply.SerializeToString())
                if not self.writable.is_set():
                    await self.writable.wait()
        except _Abort as exc:
            code, message = exc.code, exc.message
            log.info("data plane stream from %s refused: %s %s", self.transport.get_extra_info("peername"),
                     code.name, message)
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down"
            self.eof.set()          # no lingering at shutdown
        except Exception as exc:  # noqa: BLE001 - report it to the sender, keep serving others
            log.exception("data plane stream failed")
            code, message = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        finally:
            self._send(STATUS, _status_payload(code, message))
            await self._linger()

    async def _linger(self) -> None:
        """Close after the status. Input left unread would make the kernel answer the close with a reset,
        which can destroy the status before the sender reads it: what the sender still sends is read and
        dropped, briefly and up to a bound, until its FIN."""
        self.discarded = 0
        self.buf, self.filled = memoryview(bytearray(64 << 10)), 0
        if not self.transport.is_closing():
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.transport.resume_reading()
            try:
                await asyncio.wait_for(self.eof.wait(), LINGER_S)
            except asyncio.TimeoutError:
                pass
        self.transport.close()


class DataPlaneServer:
    """The receiving side's TCP listener. ``serve(source, frames, context)`` handles one sender's frames and
    yields the replies (``PeerService.serve``), ``parse`` turns a frame's bytes into a PeerFrame (or
    MALFORMED), ``rejected(code)`` counts a refused connection. Limits: see the module's docstring."""

    def __init__(self, serve, parse, max_frame_bytes: int, rejected: Callable[[grpc.StatusCode], None], *,
                 max_connections: int = 256, max_unauthenticated: int = 32, hello_timeout_s: float = 5.0,
                 idle_timeout_s: float = 300.0):
        self.serve = serve
        self.parse = parse
        self.max_frame_bytes = max_frame_bytes
        self.queue_bytes = max(QUEUE_BYTES_MIN, 2 * max_frame_bytes)
        self.rejected = rejected
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.hello_timeout_s = hello_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.tickets = Tickets()
        self.connections = set()
        self.unauthenticated = 0
        self.listener = BoundedListener(self._accepted, max_connections, what="data plane", refusal=TOO_MANY,
                                        on_refused=lambda: rejected(grpc.StatusCode.RESOURCE_EXHAUSTED))
        self._starting = set()      # tasks making transports of accepted sockets
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self.port = self.listener.start(host, port)
        return self.port

    def _accepted(self, sock) -> None:
        task = asyncio.get_running_loop().create_task(self._connect(sock))
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _connect(self, sock) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: _Connection(self), sock)
        except BaseException:       # the connection never reached connection_made: its slot is free again
            sock.close()
            self.listener.release()
            raise

    async def stop(self) -> None:
        self.listener.close()
        for task in list(self._starting):
            task.cancel()
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
        await asyncio.gather(*(c.task for c in list(self.connections) if c.task), return_exceptions=True)
