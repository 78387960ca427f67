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

Sending side: ``TcpTransport`` / ``TcpStream``. Receiving side: ``tcp_server.DataPlaneServer``, which hands
each connection's frames to ``PeerService.serve`` like ``Link``'s.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import time
from typing import Awaitable, Callable, Optional, Tuple

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto.codec import chunk_frame_prefix
from ..proto.messages import status_code
from .base import NotOffered, Stream, Transport, TransportError

log = logging.getLogger("ciuicflow.kvflow.tcp")

HEAD = struct.Struct("<BI")
MSG, HELLO, STATUS = 0, 1, 2
CONNECT_TIMEOUT_S = 5.0     # a data port that does not answer within this: use the next transport
RETRY_S = 60.0              # ... and try the data plane again after this long (at a later reconnect)


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
