"""The TCP data plane between sidecars: ``KVFlowPeer.Link``'s messages on a plain TCP connection.

Why: through gRPC's Python asyncio API every 256 KiB chunk costs each sidecar about a millisecond of CPU
(measured: 3-4 CPU s per GB per sidecar, more than a whole plain gRPC client and server together), which
caps the sidecar path far below the link on a busy host. On a plain socket the same frames cost a few
hundred microseconds: the receiver reads each frame straight into its own buffer (``BufferedProtocol``),
the sender writes header and chunk without building a message around them.

What stays on gRPC: authentication and discovery. The sender asks the receiver's ``KVFlowPeer.DataPlane``
(over the gRPC peer port, with the same token and peer-name checks as ``Link``) for the data plane's port
and a one-time ticket, connects, and presents the ticket in its hello; the ticket names the sender. Peers
with TLS keep to the gRPC stream (there is no TLS on this plane), as do ``--peer-transport grpc`` senders
and receivers started with ``--data-port -1``.

Framing: ``[kind: u8][length: u32 little-endian][payload]``. Kinds: ``MSG`` (a serialized ``PeerFrame``,
sender to receiver, or ``PeerReply``, back), ``HELLO`` (the ticket), ``STATUS`` (JSON ``{"code", "message"}``:
how the receiver ended the stream, as a gRPC status would). The sender half-closes (TCP FIN) where a gRPC
stream would close its request side.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import struct
import time
from typing import Dict, Optional, Tuple

import grpc

from ..proto.messages import status_code, uninitialized
from ..proto import kvflow_pb2 as pb

log = logging.getLogger("ciuicflow.kvflow.wire")

HEAD = struct.Struct("<BI")
MSG, HELLO, STATUS = 0, 1, 2
TICKET_TTL_S = 60.0
HELLO_TIMEOUT_S = 10.0
QUEUE_HIGH = 16            # frames read but not yet handled: stop reading from the socket above this


class LinkError(Exception):
    """The data plane stream ended with an error (the interface of ``grpc.aio.AioRpcError`` the link uses)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _tune(sock: socket.socket) -> None:
    """No Nagle delay on acknowledgements; keepalives find a peer that vanished without a FIN (as the gRPC
    channel's keepalive pings do: about 20 s)."""
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
class WireCall:
    """The sender's end of one data plane connection, shaped like the ``grpc.aio`` stream call the link
    drives: ``await write(frame)``, ``await done_writing()``, ``async for reply in call``, ``cancel()``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer

    @classmethod
    async def connect(cls, host: str, port: int, ticket: bytes, timeout: float = 10.0) -> "WireCall":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=1 << 20), timeout)
        _tune(writer.get_extra_info("socket"))
        writer.transport.set_write_buffer_limits(high=1 << 20)
        writer.write(HEAD.pack(HELLO, len(ticket)) + ticket)
        return cls(reader, writer)

    async def write(self, frame) -> None:
        await self.write_chunk(frame if isinstance(frame, bytes) else frame.SerializeToString(), b"")

    async def write_chunk(self, prefix: bytes, data) -> None:
        """One frame given as two pieces (a chunk's serialized prefix and its data), written without
        joining them."""
        if self._writer.is_closing():
            raise LinkError(grpc.StatusCode.UNAVAILABLE, "data plane connection closed")
        self._writer.write(HEAD.pack(MSG, len(prefix) + len(data)) + prefix)
        if len(data):
            self._writer.write(data)
        await self._writer.drain()

    async def done_writing(self) -> None:
        if not self._writer.is_closing() and self._writer.can_write_eof():
            self._writer.write_eof()

    def cancel(self) -> None:
        self._writer.transport.abort()

    def __aiter__(self):
        return self._replies()

    async def _replies(self):
        while True:
            try:
                kind, n = HEAD.unpack(await self._reader.readexactly(HEAD.size))
                payload = await self._reader.readexactly(n)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                raise LinkError(grpc.StatusCode.UNAVAILABLE, f"data plane connection lost: {exc}") from None
            if kind == MSG:
                yield pb.PeerReply.FromString(payload)
            elif kind == STATUS:
                code, message = _parse_status(payload)
                if code != grpc.StatusCode.OK:
                    raise LinkError(code, message)
                return
            else:
                raise LinkError(grpc.StatusCode.INTERNAL, f"unexpected frame kind {kind} from the data plane")


# ---------------------------------------------------------------------- chunk frames, by hand
_CHUNK_FIELD = (2 << 3) | 2         # PeerFrame.chunk, length-delimited
_DATA_FIELD_NUMBER = 6              # Chunk.data
_DATA_FIELD = (_DATA_FIELD_NUMBER << 3) | 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def chunk_frame_prefix(chunk: pb.Chunk, n: int) -> bytes:
    """The bytes of a serialized ``PeerFrame(chunk=...)`` that come before its ``n`` bytes of data: the
    frame is built without copying the data into a protobuf message first (constructing a message with a
    large bytes field costs ~1 ms per 256 KiB chunk on a busy host, more than everything else a chunk
    costs). Prefix + data parse as the same PeerFrame: protobuf fields may come in any order."""
    head = chunk.SerializeToString()
    if not n:
        return bytes((_CHUNK_FIELD,)) + _varint(len(head)) + head
    data_len = _varint(n)
    inner_len = len(head) + 1 + len(data_len) + n
    return b"".join((bytes((_CHUNK_FIELD,)), _varint(inner_len), head, bytes((_DATA_FIELD,)), data_len))


def encode_chunk_frame(chunk: pb.Chunk, data) -> bytes:
    """A serialized ``PeerFrame(chunk=...)`` whose ``data`` is ``data`` (see ``chunk_frame_prefix``)."""
    return chunk_frame_prefix(chunk, len(data)) + data


class ChunkFrame:
    """A ``PeerFrame(chunk=...)`` read without copying its data: ``chunk`` has every field but ``data``,
    which is ``data``, a view of the received buffer (protobuf would copy it, twice: parsing and reading
    the field; ~10% of a receiving sidecar's CPU)."""
    __slots__ = ("chunk", "data")

    def __init__(self, chunk: pb.Chunk, data):
        self.chunk, self.data = chunk, data

    @staticmethod
    def WhichOneof(_group: str) -> str:
        return "chunk"


def _varint_at(buf, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def parse_chunk_frame(payload) -> Optional[ChunkFrame]:
    """``payload`` as a ChunkFrame when it is a PeerFrame holding only a chunk; None otherwise (or when
    anything is off: the caller then lets protobuf parse it, and judge it)."""
    try:
        if not payload or payload[0] != _CHUNK_FIELD:
            return None
        inner_len, start = _varint_at(payload, 1)
        if start + inner_len != len(payload):
            return None
        pos, rest, data = start, [], b""
        while pos < len(payload):
            field_start = pos
            tag, pos = _varint_at(payload, pos)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint_at(payload, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                n, pos = _varint_at(payload, pos)
                if tag >> 3 == _DATA_FIELD_NUMBER:
                    if pos + n > len(payload):
                        return None
                    data = memoryview(payload)[pos:pos + n]
                    pos += n
                    continue
                pos += n
            else:
                return None
            if pos > len(payload):
                return None
            rest.append(bytes(payload[field_start:pos]))
        return ChunkFrame(pb.Chunk.FromString(b"".join(rest)), data)
    except Exception:       # noqa: BLE001 - protobuf decides
        return None

class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """What ``PeerService.serve_link`` needs of a gRPC servicer context."""

    async def abort(self, code: grpc.StatusCode, message: str):
        raise _Abort(code, message)


class _EOF:
    pass


class _Connection(asyncio.BufferedProtocol):
    """One sender's connection: frames are read straight into their own buffers, handed to
    ``PeerService.serve_link`` in order, and its replies written back."""

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
                self.plane.peer.sc.metrics.rejected.labels("UNAUTHENTICATED").inc()
                raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                             "data plane needs a valid ticket (from KVFlowPeer.DataPlane), once")
            async for reply in self.plane.peer.serve_link(source, self._requests(), _Context()):
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
    """The receiving side's TCP listener; frames go to ``PeerService.serve_link`` like ``Link``'s."""

    def __init__(self, peer_service, parse, max_frame_bytes: int):
        self.peer = peer_service
        self.parse = parse                      # bytes -> PeerFrame (or MALFORMED)
        self.max_frame_bytes = max_frame_bytes
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
