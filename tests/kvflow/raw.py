"""Hand-driven peer streams for tests: a ``RawLink`` on a sidecar's gRPC peer port, frames, data plane
tickets (raw data plane sessions: ciuicflow.testing.crafted.wire_session)."""
import queue

import crc32c
import grpc

from ciuicflow.kvflow.proto import kvflow_pb2 as pb

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
