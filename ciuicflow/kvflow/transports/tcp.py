"""The TCP data plane: ``KVFlowPeer.Link``'s frames on a plain TCP connection to the receiver.

Why: through gRPC's Python asyncio API each chunk costs a sidecar far more CPU than the same frame on a
plain socket, where the receiver reads each frame straight into its own buffer (``BufferedProtocol``) and
the sender writes header and chunk without building a message around them (docs/kvflow.md, Protocol).

What stays on gRPC: authentication and discovery. The sender asks the receiver's ``KVFlowPeer.DataPlane``
(over the gRPC peer port, with the same token and peer-name checks as ``Link``) for the data plane's port
and a one-time ticket, connects, and presents the ticket in its hello; the ticket names the sender. Peers
with TLS keep to the gRPC stream (there is no TLS on this plane), as do ``--peer-transport grpc`` senders
and receivers started with ``--data-port -1``.

Framing: ``[kind: u8][length: u32 little-endian][payload]``. Kinds: ``MSG`` (a serialized ``PeerFrame``,
sender to receiver, or ``PeerReply``, back), ``HELLO`` (the ticket), ``STATUS`` (JSON ``{"code", "message"}``:
how the receiver ended the stream, as a gRPC status would). The sender half-closes (TCP FIN) where a gRPC
stream would close its request side.

Sending side: ``TcpTransport`` / ``TcpStream``. Receiving side: ``DataPlaneServer``, which hands each
connection's frames to ``PeerService.serve`` like ``Link``'s.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import struct
import time
from typing import Awaitable, Callable, Dict, Optional, Tuple

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto.codec import chunk_frame_prefix, parse_chunk_frame, uninitialized
from ..proto.messages import status_code
from .base import NotOffered, Stream, Transport, TransportError

log = logging.getLogger("ciuicflow.kvflow.tcp")

HEAD = struct.Struct("<BI")
MSG, HELLO, STATUS = 0, 1, 2
TICKET_TTL_S = 60.0
HELLO_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0     # a data port that does not answer within this: use the next transport
RETRY_S = 60.0              # ... and try the data plane again after this long (at a later reconnect)
QUEUE_HIGH = 16             # frames read but not yet handled: stop reading from the socket above this


def _tune(sock: socket.socket) -> None:
    """No Nagle delay on acknowledgements; keepalives find a peer that vanished without a FIN (as the gRPC
    channel's keepalive pings do on the other transport)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _status_payload(code: grpc.StatusCode, message: str) -> bytes:
    return json.dumps({"code": code.value[0], "message": message}).encode()


def _parse_status(payload: bytes) -> Tuple[grpc.StatusCode, str]:
    try:
        d = json.loads(payload)
        return status_code(d["code"]), str(d.get("message", ""))
    except (ValueError, KeyError, TypeError):
        return grpc.StatusCode.INTERNAL, "malformed status from the peer's data plane"


class Tickets:
    """One-time tickets handed out by ``DataPlane``: ticket -> (sender name, expiry)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._issued: Dict[bytes, Tuple[str, float]] = {}

    def issue(self, source: str) -> bytes:
        now = self._clock()
        for ticket, (_, expiry) in list(self._issued.items()):
            if expiry < now:
                del self._issued[ticket]
        ticket = secrets.token_bytes(24)
        self._issued[ticket] = (source, now + TICKET_TTL_S)
        return ticket

    def redeem(self, ticket: bytes) -> Optional[str]:
        entry = self._issued.pop(bytes(ticket), None)
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]


# ---------------------------------------------------------------------- sending side
class TcpStream(Stream):
    """The sender's end of one data plane connection."""

    kind = "tcp"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, host: str, port: int, ticket: bytes, timeout: float) -> "TcpStream":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)
        _tune(writer.get_extra_info("socket"))
        writer.transport.set_write_buffer_limits(high=1 << 20)
        writer.write(HEAD.pack(HELLO, len(ticket)) + ticket)
        return cls(reader, writer)

    async def send(self, frame: pb.PeerFrame) -> None:
        await self._write(frame.SerializeToString(), b"")

    async def send_chunk(self, head: pb.Chunk, data) -> None:
        await self._write(chunk_frame_prefix(head, len(data)), data)     # no copy of the data here

    async def _write(self, prefix: bytes, data) -> None:
        """One frame given as two pieces (a chunk's serialized prefix and its data), written without
        joining them."""
        if self._writer.is_closing():
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "data plane connection closed")
        self._writer.write(HEAD.pack(MSG, len(prefix) + len(data)) + prefix)
        if len(data):
            self._writer.write(data)
        await self._writer.drain()

    async def finish_sending(self) -> None:
        if not self._writer.is_closing() and self._writer.can_write_eof():
            self._writer.write_eof()

    def abort(self) -> None:
        self._writer.transport.abort()

    async def replies(self):
        while True:
            try:
                kind, n = HEAD.unpack(await self._reader.readexactly(HEAD.size))
                payload = await self._reader.readexactly(n)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise TransportError(grpc.StatusCode.UNAVAILABLE, f"data plane connection lost: {exc}") from None
            if kind == MSG:
                yield pb.PeerReply.FromString(payload)
            elif kind == STATUS:
                code, message = _parse_status(payload)
                if code != grpc.StatusCode.OK:
                    raise TransportError(code, message)
                return
            else:
                raise TransportError(grpc.StatusCode.INTERNAL, f"unexpected frame kind {kind} from the data plane")


class TcpTransport(Transport):
    """The peer's data plane, found through ``discover()`` (``KVFlowPeer.DataPlane``: its port and a ticket,
    or None when the peer has no such method). Not offered while the peer has none, or for ``RETRY_S``
    after its port did not answer (a firewall, a port mapping that left it out)."""

    kind = "tcp"

    def __init__(self, peer: str, host: str, discover: Callable[[], Awaitable[Optional[pb.DataPlaneReply]]],
                 clock=time.monotonic):
        self.peer, self.host = peer, host
        self._discover = discover
        self._clock = clock
        self._retry_at = 0.0

    async def open(self) -> Stream:
        plane = await self._discover()
        if plane is None or not plane.port:
            raise NotOffered(f"peer {self.peer!r} offers no data plane")
        if self._clock() < self._retry_at:
            raise NotOffered(f"data plane of {self.peer!r} unreachable a moment ago")
        try:
            return await TcpStream.connect(self.host, plane.port, plane.ticket, CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            self._retry_at = self._clock() + RETRY_S
            log.warning("link to %s: data plane %s:%d unreachable (%s: %s); using the gRPC stream, "
                        "retrying the data plane in %gs", self.peer, self.host, plane.port,
                        type(exc).__name__, exc, RETRY_S)
            raise NotOffered(f"data plane {self.host}:{plane.port} unreachable") from None


# ---------------------------------------------------------------------- receiving side
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
        self.head = bytearray(HEAD.size)
        self.payload = None
        self.buf = memoryview(self.head)
        self.filled = 0
        self.kind = None
        self.paused = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.task = None

    # --- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        _tune(transport.get_extra_info("socket"))
        self.task = asyncio.get_running_loop().create_task(self._serve())
        self.plane.connections.add(self)

    def get_buffer(self, sizehint: int):
        return self.buf[self.filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled < len(self.buf):
            return
        if self.kind is None:
            kind, n = HEAD.unpack(self.head)
            if n > self.plane.max_frame_bytes:
                self.frames.put_nowait(_Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                              f"frame of {n} bytes over the limit of {self.plane.max_frame_bytes}"))
                self.transport.pause_reading()
                return
            self.payload = uninitialized(n)
            self.kind, self.buf, self.filled = kind, memoryview(self.payload), 0
            if n:
                return
        self.frames.put_nowait((self.kind, self.payload))
        self.kind, self.buf, self.filled = None, memoryview(self.head), 0
        if self.frames.qsize() >= QUEUE_HIGH and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self):
        self.frames.put_nowait(_EOF)
        return True         # keep our side open: the status still goes back

    def connection_lost(self, exc) -> None:
        log.debug("data plane connection from %s closed (%s)", self.transport.get_extra_info("peername"), exc)
        self.frames.put_nowait(_EOF)
        self.writable.set()
        self.plane.connections.discard(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # --- the stream
    async def _next(self):
        item = await self.frames.get()
        if self.paused and self.frames.qsize() < QUEUE_HIGH // 2 and not self.transport.is_closing():
            self.paused = False
            self.transport.resume_reading()
        if isinstance(item, _Abort):
            raise item
        return item

    async def _requests(self):
        while True:
            item = await self._next()
            if item is _EOF:
                return
            kind, payload = item
            if kind != MSG:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {kind} on the data plane")
            yield parse_chunk_frame(payload) or self.plane.parse(payload)

    def _send(self, kind: int, payload: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(HEAD.pack(kind, len(payload)) + payload)

    async def _serve(self) -> None:
        code, message = grpc.StatusCode.OK, ""
        try:
            try:
                item = await asyncio.wait_for(self._next(), HELLO_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no hello on the data plane") from None
            if item is _EOF:
                return
            kind, payload = item
            source = self.plane.tickets.redeem(payload) if kind == HELLO else None
            if source is None:
                self.plane.rejected(grpc.StatusCode.UNAUTHENTICATED)
                raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                             "data plane needs a valid ticket (from KVFlowPeer.DataPlane), once")
            async for reply in self.plane.serve(source, self._requests(), _Context()):
                data = reply.SerializeToString()
                self._send(MSG, data)
                if not self.writable.is_set():
                    await self.writable.wait()
        except _Abort as exc:
            code, message = exc.code, exc.message
            log.info("data plane stream from %s refused: %s %s", self.transport.get_extra_info("peername"),
                     code.name, message)
        except asyncio.CancelledError:
            code, message = grpc.StatusCode.UNAVAILABLE, "sidecar is shutting down"
        except Exception as exc:  # noqa: BLE001 - report it to the sender, keep serving others
            log.exception("data plane stream failed")
            code, message = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
        finally:
            self._send(STATUS, _status_payload(code, message))
            self.transport.close()


class DataPlaneServer:
    """The receiving side's TCP listener. ``serve(source, frames, context)`` handles one sender's frames and
    yields the replies (``PeerService.serve``), ``parse`` turns a frame's bytes into a PeerFrame (or
    MALFORMED), ``rejected(code)`` counts a refused connection."""

    def __init__(self, serve, parse, max_frame_bytes: int, rejected: Callable[[grpc.StatusCode], None]):
        self.serve = serve
        self.parse = parse
        self.max_frame_bytes = max_frame_bytes
        self.rejected = rejected
        self.tickets = Tickets()
        self.connections = set()
        self.server: Optional[asyncio.base_events.Server] = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Connection(self), host or None, port,
                                               reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is None:
            return
        self.server.close()
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
        await asyncio.gather(*(c.task for c in list(self.connections) if c.task), return_exceptions=True)
        await self.server.wait_closed()
