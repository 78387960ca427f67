"""The outgoing transfer's state machine (core/transfer.py) on a simulated clock: handshake, resume,
acknowledgements of every kind, commit, reconnects, timers, a durable receiver; and the fault injectors of
ciuicflow.testing.kvflow_faults on their own."""
import asyncio
import random

import grpc
import pytest

from ciuicflow.kvflow.core.transfer import DONE, FAILED, NEW, OPEN, OPENING, Limits, OutChunk, Transfer
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.transports.base import Stream, Transport
from ciuicflow.testing.kvflow_faults import CorruptingTransport, Faults, RateLimit
from tests.kvflow.sidecars import FakeClock

LIMITS = Limits(max_retransmits=2, stall_timeout_s=3.0, resume_timeout_s=5.0, busy_backoff_s=0.05)


def chunk(i: int, n: int = 10) -> OutChunk:
    return OutChunk(part=i, offset=0, data=bytes([i]) * n, crc=1000 + i, info=None)


def make(clock, **kw) -> Transfer:
    return Transfer(7, "k", "b", kw.pop("priority", "normal"), limits=LIMITS, clock=clock, **kw)


def ack(t, seq, code=pb.ACK_OK, **kw):
    return pb.Ack(tid=t.tid, seq=seq, sn=seq + 1, code=code, **kw)


def send_all(t):
    """Take every chunk that may go now; their seqs."""
    seqs = []
    while t.head_ready(t.clock()):
        seqs.append(t.take_chunk()[0])
    return seqs


def test_kvflow_transfer_fresh_open_sends_at_once_and_commits():
    clock = FakeClock(100.0)
    t = make(clock, deadline=clock() + 2.0)
    assert t.state == NEW and not t.head_ready(clock())
    for i in range(3):
        t.add_chunk(chunk(i))
    frame = t.open()
    assert t.state == OPEN                      # a first, non-resuming open: chunks follow at once
    assert frame.key == "k" and frame.uuid == t.uuid and frame.deadline_s == pytest.approx(2.0)
    assert t.head_bytes(clock()) == 10
    seq, c, first = t.take_chunk()
    assert (seq, c.data, first) == (0, bytes([0]) * 10, True)
    assert send_all(t) == [1, 2]
    assert t.sent_bytes == 30 and t.unsent_bytes == 0
    assert not t.commit_due()                   # not closed yet
    t.close(3)
    assert t.commit_due()
    commit = t.commit()
    assert (commit.total_chunks, commit.num_parts) == (3, 3) and not t.commit_due()
    t.on_state(pb.TransferState(tid=7))         # the receiver confirms the optimistic start
    assert t.state == OPEN and t.next_seq == 3
    for i in range(3):
        t.on_ack(ack(t, i))
    assert t.acked == 3
    clock.advance(0.5)
    t.on_commit(pb.CommitAck(tid=7))
    assert t.state == DONE and t.finished
    reply = t.reply()
    assert (reply.bytes, reply.chunks, reply.retransmits, reply.seconds) == (30, 3, 0, pytest.approx(0.5))


def test_kvflow_transfer_resume_skips_what_the_receiver_holds():
    clock = FakeClock(100.0)
    t = make(clock, resume=True)
    for i in range(4):
        t.add_chunk(chunk(i))
    t.open()
    assert t.state == OPENING and not t.head_ready(clock())       # waits for the receiver's answer
    # the receiver holds chunks 0 and 1 with the same content, and a different chunk 2
    t.on_state(pb.TransferState(tid=7, held_chunks=3, held_crc32c=[1000, 1001, 999]))
    assert t.state == OPEN
    assert (t.next_seq, t.acked, t.resumed) == (2, 2, 2)
    assert send_all(t) == [2, 3]
    assert t.sent_bytes == 40                   # skipped chunks count as sent once


def test_kvflow_transfer_receiver_complete_already():
    clock = FakeClock(100.0)
    t = make(clock, resume=True)
    t.add_chunk(chunk(0))
    t.open()
    t.on_state(pb.TransferState(tid=7, complete=True))
    assert t.state == DONE and t.resumed == 1


def test_kvflow_transfer_corrupt_chunks_go_again_then_data_loss():
    clock = FakeClock(100.0)
    t = make(clock)
    for i in range(3):
        t.add_chunk(chunk(i))
    t.open()
    assert send_all(t) == [0, 1, 2]
    t.on_ack(ack(t, 0))
    t.on_ack(ack(t, 1, pb.ACK_CORRUPT))
    assert t.next_seq == 1 and t.retransmits == 1   # back to the corrupt chunk
    t.on_ack(ack(t, 2, pb.ACK_OUT_OF_ORDER))          # the receiver dropped the one after it
    assert t.next_seq == 1
    assert send_all(t) == [1, 2]
    t.on_ack(ack(t, 1, pb.ACK_CORRUPT))
    assert t.state == OPEN                          # 2 failures: still within max_retransmits
    t.on_ack(ack(t, 1, pb.ACK_CORRUPT))
    assert t.state == FAILED
    assert t.failure.code == grpc.StatusCode.DATA_LOSS and "3 times" in t.failure.message
    assert t.failure.tell_peer                      # the receiver is told
    assert not t.fail(grpc.StatusCode.CANCELLED, "too late")   # the first outcome stays


def test_kvflow_transfer_busy_receiver_backs_off_then_stalls():
    clock = FakeClock(100.0)
    t = make(clock)
    for i in range(2):
        t.add_chunk(chunk(i))
    t.close(2)
    t.open()
    assert send_all(t) == [0, 1]
    t.on_ack(ack(t, 0, pb.ACK_BUSY))
    assert t.next_seq == 0 and t.last_busy
    assert not t.head_ready(clock())                # waits out the back-off
    clock.advance(0.06)
    assert t.head_ready(clock())
    # nothing acknowledged for the stall timeout while the receiver refused: RESOURCE_EXHAUSTED
    clock.advance(2.0)
    t.check_time(clock(), peer_down_since=None)
    assert t.state == OPEN
    clock.advance(1.5)
    t.check_time(clock(), peer_down_since=None)
    assert t.state == FAILED and t.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_kvflow_transfer_stall_without_busy_is_unavailable():
    clock = FakeClock(100.0)
    t = make(clock)
    t.add_chunk(chunk(0))
    t.open()
    send_all(t)
    clock.advance(3.5)
    t.check_time(clock(), peer_down_since=None)
    assert t.failure.code == grpc.StatusCode.UNAVAILABLE and "no progress" in t.failure.message


def test_kvflow_transfer_reconnect_reopens_and_peer_gone_fails():
    clock = FakeClock(100.0)
    t = Transfer(7, "k", "b", "normal", limits=Limits(stall_timeout_s=60.0, resume_timeout_s=5.0), clock=clock)
    t.add_chunk(chunk(0))
    t.open()
    send_all(t)
    t.disconnected()
    assert t.state == NEW and t.remote_crcs is None
    t.open()
    assert t.state == OPENING                       # a re-open waits for what the receiver holds
    t.on_state(pb.TransferState(tid=7, held_chunks=0))
    assert t.state == OPEN and t.next_seq == 0      # sent again from the start
    t.disconnected()
    down = clock()
    clock.advance(4.0)
    t.check_time(clock(), peer_down_since=down, peer_address="10.0.0.2:1")
    assert t.state == NEW
    clock.advance(1.5)
    t.check_time(clock(), peer_down_since=down, peer_address="10.0.0.2:1")
    assert t.failure.code == grpc.StatusCode.UNAVAILABLE and "10.0.0.2:1 unreachable" in t.failure.message
    assert not t.failure.tell_peer                  # nothing open on any connection


def test_kvflow_transfer_deadline():
    clock = FakeClock(100.0)
    t = make(clock, deadline=clock() + 1.0)
    t.add_chunk(chunk(0))
    t.open()
    clock.advance(1.01)
    t.check_time(clock(), peer_down_since=None)
    assert t.failure.code == grpc.StatusCode.DEADLINE_EXCEEDED and "0 of 1 chunks" in t.failure.message


def test_kvflow_transfer_durable_receiver_frees_acked_chunks():
    clock = FakeClock(100.0)
    t = make(clock)
    for i in range(3):
        t.add_chunk(chunk(i))
    t.buffered = 30
    t.open()
    send_all(t)
    assert t.on_ack(ack(t, 0), durable=True) == 10
    assert t.on_ack(ack(t, 1), durable=True) == 10
    assert (t.released, t.buffered) == (2, 10) and t.chunks[0].data == b""
    assert t.on_ack(ack(t, 2), durable=False) == 0
    # after a reconnect the receiver holds only one chunk: two were freed here, so they are lost
    t.disconnected()
    t.open()
    t.on_state(pb.TransferState(tid=7, held_chunks=1, held_crc32c=[1000]))
    assert t.state == FAILED and t.failure.code == grpc.StatusCode.DATA_LOSS
    assert "lost chunks it had acknowledged" in t.failure.message


def test_kvflow_transfer_failures_reported_by_the_peer_are_not_echoed():
    clock = FakeClock(100.0)
    for reply in (pb.TransferState(tid=7, error_code=grpc.StatusCode.ALREADY_EXISTS.value[0], error="dup"),
                  pb.Ack(tid=7, seq=0, code=pb.ACK_FAILED, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0]),
                  pb.CommitAck(tid=7, error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")):
        t = make(clock)
        t.add_chunk(chunk(0))
        t.open()
        send_all(t)
        {pb.TransferState: t.on_state, pb.Ack: t.on_ack, pb.CommitAck: t.on_commit}[type(reply)](reply)
        assert t.state == FAILED and not t.failure.tell_peer
    t = make(clock)
    t.fail(grpc.StatusCode.CANCELLED, "before any open")
    assert not t.failure.tell_peer


# ---------------------------------------------------------------------- the fault injectors
class _RecordingStream(Stream):
    kind = "fake"

    def __init__(self):
        self.chunks = []

    async def send(self, frame):
        pass

    async def send_chunk(self, head, data):
        self.chunks.append(bytes(data))

    async def finish_sending(self):
        pass

    async def replies(self):
        return
        yield

    def abort(self):
        pass


class _FakeTransport(Transport):
    kind = "fake"

    def __init__(self):
        self.streams = []

    async def open(self):
        self.streams.append(_RecordingStream())
        return self.streams[-1]


def test_kvflow_corrupting_transport_flips_one_in_n():
    inner = _FakeTransport()
    transport = CorruptingTransport(inner, 4, random.Random(1))

    async def run():
        stream = await transport.open()
        assert stream.kind == "fake"
        for _ in range(400):
            await stream.send_chunk(pb.Chunk(), b"\x00" * 8)
    asyncio.run(run())
    corrupt = [c for c in inner.streams[0].chunks if c != b"\x00" * 8]
    assert 60 < len(corrupt) < 140 and all(c == b"\xff" + b"\x00" * 7 for c in corrupt)
    seams = Faults(corrupt_every=4).seams()
    assert set(seams) == {"wrap_transport"} and isinstance(seams["wrap_transport"](inner), CorruptingTransport)
    assert Faults(corrupt_every=3, link_rate=8_000_000).flags() == ["--test-corrupt-every", "3",
                                                                    "--link-rate", "8000000"]


def test_kvflow_rate_limit_paces_bytes():
    clock = FakeClock(0.0)
    bucket = RateLimit(1000.0, burst=100, clock=clock)
    assert bucket.take(100) == 0.0                  # the burst
    assert bucket.take(500) == pytest.approx(0.5)   # 500 bytes over 1000 B/s
    clock.advance(0.5)
    assert bucket.take(100) == pytest.approx(0.1)
    clock.advance(10.0)
    assert bucket.take(50) == 0.0                   # refilled, capped at the burst


def test_kvflow_transfer_local_sender_silent_too_long_fails():
    """A Send whose client stops without ending it fails after the stall timeout (nothing outstanding)."""
    clock = FakeClock(100.0)
    t = make(clock)
    t.add_chunk(chunk(0))
    t.open()
    send_all(t)
    t.on_ack(ack(t, 0))
    clock.advance(2.0)
    t.add_chunk(chunk(1))          # more input: the clock restarts
    send_all(t)
    t.on_ack(ack(t, 1))
    clock.advance(2.9)
    t.check_time(clock(), peer_down_since=None)
    assert t.state == OPEN
    clock.advance(0.2)
    t.check_time(clock(), peer_down_since=None)
    assert t.state == FAILED and t.failure.code == grpc.StatusCode.CANCELLED and t.failure.tell_peer


def test_kvflow_transfer_revived_after_the_receiver_lost_it():
    """A committed transfer the receiver lost (not durable) goes out again: reopened as a resume, all of
    its chunks, and committed again."""
    clock = FakeClock(100.0)
    t = make(clock)
    for i in range(3):
        t.add_chunk(chunk(i))
    t.close(3)
    t.open()
    send_all(t)
    for i in range(3):
        t.on_ack(ack(t, i))
    t.commit()
    t.on_commit(pb.CommitAck(tid=t.tid, lease_s=30.0, queries=True))
    assert t.state == DONE and not t.durable and t.queryable and t.lease_s == 30.0
    t.revive()
    assert t.state == NEW
    frame = t.open()
    assert frame.resume and t.state == OPENING
    t.on_state(pb.TransferState(tid=t.tid))                # it holds nothing
    assert send_all(t) == [0, 1, 2]
    for i in range(3):
        t.on_ack(ack(t, i))
    assert t.commit_due()
    t.commit()
    t.on_commit(pb.CommitAck(tid=t.tid, durable=True))
    assert t.state == DONE and t.durable
