"""Part descriptions in packed chunks are bounded: a peer's valid-looking chunk frame carrying a million
zero-byte part descriptions is refused on both transports (gRPC Link and the TCP data plane) without
being expanded, the receiver's memory stays within its cap, its local Stats keeps answering, and a
legitimate transfer beside the flood completes. Real sidecar processes on 127.0.0.1."""
import json
import os
import subprocess
import sys
import time

import crc32c
import grpc

from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.proto.messages import MAX_PACKED_PARTS
from ciuicflow.kvflow.transports.tcp import HELLO, MSG, STATUS
from ciuicflow.testing.crafted import more_block, wire_session, zero_parts_frame
from tests import REPO
from tests.kvflow.raw import LINK, open_frame, ticket

PEER_A = (("x-ciuic-peer", "a"),)     # a configured peer's name, no credentials (the default settings)
PARTS = 1_300_000                       # zero-byte part descriptions in one crafted frame (~7.8 MB)
RSS_FIXED = 48 << 20                    # besides 1.5x the cap: frames in flight, allocator (as test_kvflow_limits)
STATS_WITHIN_S = 0.1                    # the target, for 95% of the local Stats calls during the flood ...
STATS_STALL_S = 0.5                     # ... and every one: room for a shared, busy host's scheduling (a
#                                         receiver that expands the descriptions stalls for seconds)
FLOOD_S = 1.0                           # crafted frames go for this long, in rounds


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _flood_link(listen: str, frames, tag: str) -> list:
    """The crafted frames on a gRPC Link stream, each after its transfer's open; the acks."""
    with grpc.insecure_channel(listen, options=[("grpc.max_send_message_length", 16 << 20)]) as channel:
        link = channel.stream_stream(LINK, request_serializer=lambda raw: raw,
                                     response_deserializer=pb.PeerReply.FromString)
        requests = []
        for tid, frame in frames:
            requests += [open_frame(f"flood-grpc-{tag}-{tid}", tid=tid).SerializeToString(), frame]
        replies = list(link(iter(requests), metadata=PEER_A, timeout=60))
    return [r.ack for r in replies if r.HasField("ack")]


def _flood_data_plane(b, frames, tag: str) -> list:
    """The crafted frames on the TCP data plane, each after its transfer's open; the acks."""
    plane = ticket(b.listen, PEER_A)
    session = [(HELLO, plane.ticket)]
    for tid, frame in frames:
        session += [(MSG, open_frame(f"flood-tcp-{tag}-{tid}", tid=tid).SerializeToString()), (MSG, frame)]
    replies = wire_session(plane.port, session)
    assert replies[-1] == (STATUS, 0)
    out = [pb.PeerReply.FromString(payload) for kind, payload in replies if kind == MSG]
    return [r.ack for r in out if r.HasField("ack")]


SAMPLER = """
import json, sys, time
from ciuicflow.kvflow import Client
client = Client(sys.argv[1])
client.stats()                                  # connected before the measurement
print("ready", flush=True)
samples, stop = [], time.monotonic() + float(sys.argv[2])
while time.monotonic() < stop:
    t0 = time.monotonic()
    client.stats()
    samples.append((t0, time.monotonic() - t0))
    time.sleep(0.005)
print(json.dumps(samples), flush=True)
"""


class StatsSampler:
    """Local Stats calls one after another for ``seconds``, from a process of their own (this one is busy
    flooding): (start, latency) of each, on the shared monotonic clock."""

    def __init__(self, api: str, seconds: float):
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", SAMPLER, api, str(seconds)], stdout=subprocess.PIPE,
                                     text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready"

    def samples(self) -> list:
        out, _ = self.proc.communicate(timeout=120)
        return json.loads(out)


def test_packed_chunk_with_a_million_part_descriptions_is_refused(sidecars):
    cap = 32 << 20
    b = sidecars.make("b", args=["--max-peer-bytes", str(cap), "--max-total-bytes", str(cap)])
    a = sidecars.make("a", peers={"b": b.listen})
    b.peers = {"a": a.listen}
    sidecars.start_all(b, a)
    block = more_block(PARTS)
    frames = [(tid, zero_parts_frame(tid, block)) for tid in (1, 2)]
    assert len(frames[0][1]) > 7_500_000
    warm = os.urandom(4 << 20)
    a.client().send("b", "warm", warm).wait(30)
    assert b.client().recv("warm", timeout_s=10) == warm
    sampler = StatsSampler(b.api, FLOOD_S + 1.0)
    base = _status_kib(b.proc.pid, "VmRSS") << 10
    with open(f"/proc/{b.proc.pid}/clear_refs", "w") as fh:
        fh.write("5")                           # restart the peak (VmHWM) from here

    legit = os.urandom(8 << 20)
    handle = a.client().send("b", "legit", legit)
    acks, rounds, start = [], 0, time.monotonic()
    while rounds < 1 or time.monotonic() - start < FLOOD_S:    # one round at least, on both transports
        acks += _flood_link(b.listen, frames, str(rounds)) + _flood_data_plane(b, frames, str(rounds))
        rounds += 1
    end = time.monotonic()
    handle.wait(60)
    assert b.client().recv("legit", timeout_s=10) == legit
    samples = sampler.samples()
    peak = _status_kib(b.proc.pid, "VmHWM") << 10

    assert len(acks) == 4 * rounds
    for ack in acks:
        assert ack.code == pb.ACK_FAILED and ack.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], ack
        assert f"more than {MAX_PACKED_PARTS} parts" in ack.message
    assert peak - base <= 1.5 * cap + RSS_FIXED, (peak - base) / 2 ** 20
    during = sorted(latency for t0, latency in samples if start <= t0 <= end)
    assert len(during) >= 20, samples
    assert during[int(0.95 * len(during))] < STATS_WITHIN_S, during
    assert max(latency for _, latency in samples) < STATS_STALL_S, samples
    memory = b.client().stats()["memory"]
    assert memory["peak"] <= cap and memory["used"] == 0, memory


def test_part_descriptions_are_bounded_before_protobuf_expands_them():
    """The receiving side's parser (both transports) reads at most one part description too many, and
    refuses chunks that no sender writes before protobuf sees them; legitimate packed chunks read whole."""
    from ciuicflow.kvflow.proto.codec import MALFORMED, ChunkFrame, encode_chunk_frame, safe_deserializer
    parse = safe_deserializer(pb.PeerFrame.FromString)
    frame = zero_parts_frame(7, more_block(PARTS))
    t0 = time.monotonic()
    got = parse(frame)
    assert time.monotonic() - t0 < 0.05
    assert isinstance(got, ChunkFrame) and got.chunk.tid == 7 and 1 + len(got.chunk.more) == MAX_PACKED_PARTS + 1
    assert parse(frame + b"\x12\x00") is MALFORMED          # a second chunk field: not handed to protobuf
    long_name = pb.Chunk(tid=1, info=pb.PartInfo(index=0, name="n" * 20000))
    assert parse(encode_chunk_frame(long_name, b"")) is MALFORMED
    infos = [pb.PartInfo(index=k, nbytes=3, name=f"layer.{k}") for k in range(MAX_PACKED_PARTS)]
    data = os.urandom(3 * MAX_PACKED_PARTS)
    legit = pb.Chunk(tid=1, part=0, info=infos[0], more=infos[1:], crc32c=crc32c.crc32c(data))
    got = parse(encode_chunk_frame(legit, data))
    assert list(got.chunk.more) == infos[1:] and bytes(got.data) == data
    assert parse(pb.PeerFrame(commit=pb.Commit(tid=1, total_chunks=2)).SerializeToString()).commit.total_chunks == 2


def test_many_small_layers_pack_within_the_bound(sidecars, tmp_path):
    """What the sender packs (ingest's whole-parts packing) stays within the bound the receiver enforces,
    live and from its spool: 300 tiny layers arrive, in packed chunks of at most MAX_PACKED_PARTS parts."""
    a, b = sidecars.pair(b_args=["--spool-dir", str(tmp_path / "spool")])
    a.client().send("b", "warm", [b"x" * 65536] * 61).wait(30)       # the link's rate is known: packing on
    layers = [os.urandom(64 + i) for i in range(300)]
    result = a.client().send("b", "tiny", layers).wait(30)
    assert -(-len(layers) // MAX_PACKED_PARTS) <= result.chunks < len(layers) // 4
    b.kill9()
    b.restart()
    assert "restored" in b.log()
    assert b.client().recv("tiny", timeout_s=10) == layers
