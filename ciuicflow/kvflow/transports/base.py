"""The seam for peer transports: how one sender's frames reach a peer's receiver, and its replies come back.

A ``Transport`` opens ``Stream``s to one peer. A stream carries ``PeerFrame``s to the receiver (a chunk's
frame as its head and its data, so that a transport can write the data without copying it into a message)
and yields the receiver's ``PeerReply``s. It ends with ``TransportError`` when the receiver ends it with a
status other than OK, or the connection breaks. A transport the peer does not offer at the moment raises
``NotOffered`` from ``open()``, and the sender tries the next one (``PeerSender`` holds them in order of
preference).

The receiving half of a transport hands the frames of each stream, with the sender's name, to
``PeerService.serve(source, frames, context)`` and writes back what it yields; ``context.abort(code,
message)`` ends the stream with that status.
"""
from __future__ import annotations

import abc
import logging
from typing import AsyncIterator, Sequence

import grpc

from ..proto import kvflow_pb2 as pb

log = logging.getLogger("ciuicflow.kvflow.transports")


class TransportError(Exception):
    """The stream ended with a status (the receiver's, or UNAVAILABLE for a broken connection)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class NotOffered(Exception):
    """The peer does not offer this transport now (why: the message); use the next one."""


class Stream(abc.ABC):
    """One open stream to a peer's receiver."""

    kind: str = ""                  # what ``stats()`` reports as the peer's transport

    @abc.abstractmethod
    async def send(self, frame: pb.PeerFrame) -> None:
        """Write one frame (waits while the transport's buffers are full)."""

    @abc.abstractmethod
    async def send_chunk(self, head: pb.Chunk, data) -> None:
        """Write ``PeerFrame(chunk=head)`` with ``data`` as the chunk's bytes (``head.data`` is empty)."""

    @abc.abstractmethod
    async def finish_sending(self) -> None:
        """No more frames: the receiver ends the stream once it has handled them."""

    @abc.abstractmethod
    def replies(self) -> AsyncIterator[pb.PeerReply]:
        """The receiver's replies, until it ends the stream (raises TransportError unless that is with OK)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop the stream at once (frames not yet written are lost)."""


class Transport(abc.ABC):
    """Opens streams to one peer."""

    kind: str = ""

    @abc.abstractmethod
    async def open(self) -> Stream:
        """A new stream; raises NotOffered (try the next transport), TransportError or OSError."""


async def open_first(transports: Sequence[Transport]) -> Stream:
    """A stream over the first transport the peer offers; the last one is not asked whether it is offered."""
    for transport in transports[:-1]:
        try:
            return await transport.open()
        except NotOffered as why:
            log.debug("not over %s: %s", transport.kind, why)
    return await transports[-1].open()
