"""Hand-driven peer streams for tests: a ``RawLink`` on a sidecar's gRPC peer port, frames, data plane
tickets and raw data plane sessions."""
import json
import queue
import socket

import crc32c
import grpc

from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.transports.tcp import HEAD, STATUS

LINK = "/ciuicflow.kvflow.v1.KVFlowPeer/Link"


class RawLink:
    """A Link stream driven by hand: ``send`` frames, ``recv`` the next reply (raises the call's error)."""

    def __init__(self, listen, metadata, credentials=None, timeout=30):
        self.channel = grpc.secure_channel(listen, credentials) if credentials else grpc.insecure_channel(listen)
        self.frames = queue.Queue()
        link = self.channel.stream_stream(LINK, request_serializer=pb.PeerFrame.SerializeToString,
                                          response_deserializer=pb.PeerReply.FromString)
        self.replies = link(iter(self.frames.get, None), metadata=metadata, timeout=timeout)

    def send(self, frame: pb.PeerFrame) -> None:
        self.frames.put(frame)

    def recv(self) -> pb.PeerReply:
        return next(self.replies)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.frames.put(None)
        self.replies.cancel()
        self.channel.close()


def open_frame(key, uuid="u-1", resume=False, tid=1, **fields):
    return pb.PeerFrame(open=pb.TransferOpen(tid=tid, key=key, uuid=uuid, resume=resume, payload_kind="bytes",
                                             **fields))


def chunk(data, tid=1, seq=0, part=None, info=None):
    """The first (and only) chunk of part ``part`` (default: ``seq``), described by ``info``."""
    part = seq if part is None else part
    info = info or pb.PartInfo(index=part, nbytes=len(data))
    return pb.PeerFrame(chunk=pb.Chunk(tid=tid, seq=seq, sn=seq + 1, part=part, offset=0, data=data,
                                       crc32c=crc32c.crc32c(data), info=info))


DATA_PLANE = "/ciuicflow.kvflow.v1.KVFlowPeer/DataPlane"


def ticket(listen, metadata):
    with grpc.insecure_channel(listen) as ch:
        call = ch.unary_unary(DATA_PLANE, request_serializer=pb.DataPlaneRequest.SerializeToString,
                              response_deserializer=pb.DataPlaneReply.FromString)
        return call(pb.DataPlaneRequest(), metadata=metadata, timeout=10)


def wire_session(port, frames):
    """Send raw data-plane frames ((kind, payload) pairs); the frames that come back until the status."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for kind, payload in frames:
            s.sendall(HEAD.pack(kind, len(payload)) + payload)
        try:
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass        # the receiver may have refused and closed already
        data = b""
        while True:
            more = s.recv(1 << 16)
            if not more:
                break
            data += more
    out, pos = [], 0
    while pos + HEAD.size <= len(data):
        kind, n = HEAD.unpack_from(data, pos)
        payload = data[pos + HEAD.size:pos + HEAD.size + n]
        pos += HEAD.size + n
        out.append((kind, json.loads(payload)["code"] if kind == STATUS else payload))
    return out
