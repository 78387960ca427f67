"""The gRPC transport: ``KVFlowPeer.Link``, one bidirectional stream per sender and receiver.

It works wherever the peer's gRPC port does (TLS, proxies), at a higher CPU cost per chunk than the TCP
data plane (tcp.py). Its receiving half is ``PeerService.Link``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import grpc

from ..proto import kvflow_pb2 as pb
from ..proto import kvflow_pb2_grpc as pb_grpc
from ..proto.codec import encode_chunk_frame
from .base import Stream, Transport, TransportError


def _serialize_frame(frame) -> bytes:
    """Link's request serializer: a PeerFrame, or a chunk frame encoded already (see encode_chunk_frame)."""
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


class _EncodedFrames:
    """The channel as the generated stub sees it, but with ``Link``'s requests serialized by
    ``_serialize_frame``: chunk frames are encoded without copying their data into a message first."""

    def __init__(self, channel: grpc.aio.Channel):
        self._channel = channel

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, **kwargs):
        return self._channel.stream_stream(method, request_serializer=_serialize_frame,
                                           response_deserializer=response_deserializer, **kwargs)

    def unary_unary(self, *args, **kwargs):
        return self._channel.unary_unary(*args, **kwargs)


class PeerChannel:
    """The gRPC channel to one peer's ``--listen`` port and the metadata the sender presents on it. The TCP
    data plane uses it too: its port and ticket come from ``data_plane()``."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[Tuple[str, str]]):
        self.channel = channel
        self.metadata = tuple(metadata)
        self.stub = pb_grpc.KVFlowPeerStub(_EncodedFrames(channel))

    async def data_plane(self, timeout: float = 10.0) -> Optional[pb.DataPlaneReply]:
        """The peer's data plane port and a ticket (port 0: it has none); None when it lacks the method."""
        try:
            return await self.stub.DataPlane(pb.DataPlaneRequest(), metadata=self.metadata, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise TransportError(exc.code(), exc.details() or "") from None

    async def close(self) -> None:
        await self.channel.close(grace=None)


class GrpcStream(Stream):
    kind = "grpc"

    def __init__(self, call):
        self._call = call

    async def send(self, frame) -> None:
        try:
            await self._call.write(frame)
        except grpc.aio.AioRpcError as exc:
            raise TransportError(exc.code(), exc.details() or "") from None

    async def send_chunk(self, head: pb.Chunk, data) -> None:
        await self.send(encode_chunk_frame(head, data))

    async def finish_sending(self) -> None:
        await self._call.done_writing()

    async def replies(self):
        try:
            async for reply in self._call:
                yield reply
        except grpc.aio.AioRpcError as exc:
            raise TransportError(exc.code(), exc.details() or "") from None

    def abort(self) -> None:
        self._call.cancel()


class GrpcStreamTransport(Transport):
    kind = "grpc"

    def __init__(self, peer: PeerChannel):
        self.peer = peer

    async def open(self) -> Stream:
        return GrpcStream(self.peer.stub.Link(metadata=self.peer.metadata))
