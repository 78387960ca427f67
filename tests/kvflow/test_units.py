"""Deterministic unit tests of the pure parts: scheduler, congestion controller (simulated clock), config,
payload encoding."""
import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuicflow.kvflow.sidecar.config import parse_hostport, parse_size
from ciuicflow.kvflow.sidecar.config import load_config
from ciuicflow.kvflow.core.congestion import PROBE_BW, PROBE_RTT, CongestionController
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.core.scheduler import Scheduler
from tests.kvflow.sidecars import FakeClock

CHUNK = 256 << 10


# ---------------------------------------------------------------------- scheduler
def drain(s: Scheduler, clock: FakeClock, sizes: dict, per_pick_s: float = 0.0, limit: int = 10_000):
    """Serve every transfer's chunks: sizes[tid] = list of chunk sizes. Returns the pick order."""
    order = []
    for tid, chunks in sizes.items():
        if chunks:
            s.set_ready(tid, chunks[0])
    while len(order) < limit:
        tid = s.pick()
        if tid is None:
            break
        order.append(tid)
        sizes[tid].pop(0)
        clock.advance(per_pick_s)
        s.set_ready(tid, sizes[tid][0] if sizes[tid] else 0)
    return order


def test_kvflow_scheduler_high_preempts_at_chunk_boundary():
    clock = FakeClock()
    s = Scheduler(clock, max_wait_s=10)
    s.add("bulk", "low")
    s.set_ready("bulk", CHUNK)
    assert s.pick() == "bulk"
    s.set_ready("bulk", CHUNK)
    s.add("urgent", "high")
    s.set_ready("urgent", CHUNK)
    # the very next chunk is the high one, and all of it goes before bulk continues
    assert s.pick() == "urgent"
    s.set_ready("urgent", CHUNK)
    assert s.pick() == "urgent"
    s.set_ready("urgent", 0)
    assert s.pick() == "bulk"


def test_kvflow_scheduler_edf_inside_high():
    clock = FakeClock()
    s = Scheduler(clock)
    s.add("late", "high", deadline=5.0)
    s.add("none", "high", deadline=None)
    s.add("early", "high", deadline=1.0)
    order = drain(s, clock, {"late": [10], "none": [10], "early": [10]})
    assert order == ["early", "late", "none"]


def test_kvflow_scheduler_drr_shares_by_quantum():
    clock = FakeClock()
    s = Scheduler(clock, quantum={"normal": 3 * CHUNK, "low": CHUNK})
    s.add("n", "normal")
    s.add("l", "low")
    order = drain(s, clock, {"n": [CHUNK] * 300, "l": [CHUNK] * 300}, limit=400)
    n, l = order.count("n"), order.count("l")
    assert n + l == 400
    assert 2.8 < n / l < 3.2
    # interleaved, not one after the other
    assert "l" in order[:8]


def test_kvflow_scheduler_fifo_inside_class_and_small_chunks():
    clock = FakeClock()
    s = Scheduler(clock)
    s.add("first", "normal")
    s.add("second", "normal")
    order = drain(s, clock, {"first": [1000] * 5, "second": [1000] * 5})
    assert order == ["first"] * 5 + ["second"] * 5


def test_kvflow_scheduler_aging_prevents_starvation():
    clock = FakeClock()
    s = Scheduler(clock, max_wait_s=0.5)
    s.add("h", "high")
    s.add("l", "low")
    # a continuous high load, one chunk every 10 ms
    order = drain(s, clock, {"h": [CHUNK] * 1000, "l": [CHUNK] * 10}, per_pick_s=0.01, limit=600)
    low_positions = [i for i, tid in enumerate(order) if tid == "l"]
    assert len(low_positions) == 10                  # low finished although high never stopped
    gaps = [b - a for a, b in zip([-1] + low_positions, low_positions)]
    assert max(gaps) <= 52                           # ~0.5 s of 10 ms picks between low chunks
    assert s.stats.aged == 10
    # without aging, low waits for all of high
    clock2 = FakeClock()
    s2 = Scheduler(clock2, max_wait_s=math.inf)
    s2.add("h", "high")
    s2.add("l", "low")
    order2 = drain(s2, clock2, {"h": [CHUNK] * 100, "l": [CHUNK] * 3}, per_pick_s=0.01)
    assert order2 == ["h"] * 100 + ["l"] * 3


def test_kvflow_scheduler_bad_input():
    s = Scheduler(FakeClock())
    with pytest.raises(ValueError):
        s.add("x", "urgent")
    s.add("x", "low")
    with pytest.raises(KeyError):
        s.add("x", "low")
    assert s.pick() is None
    s.remove("x")
    s.remove("x")
    assert len(s) == 0


# ---------------------------------------------------------------------- congestion controller
def simulate(rate: float, rtt: float, duration: float, chunk: int = CHUNK, app_gap=None, ack_every: float = 0.0,
             **cc_kwargs):
    """A bottleneck link (FIFO queue at ``rate`` bytes/s) plus ``rtt`` of propagation, driven on a fake
    clock. ``ack_every``: the receiver releases acknowledgements in batches, every so many seconds (a busy
    host). Returns (controller, bytes delivered, queueing delays of the chunks after the first second)."""
    clock = FakeClock()
    cc = CongestionController(clock, chunk_bytes=chunk, **cc_kwargs)
    acks = []
    link_free = 0.0
    sn = 0
    delivered = 0
    qdelay = []
    while clock.t < duration:
        while acks and acks[0][0] <= clock.t:
            _, s, size = heapq.heappop(acks)
            cc.on_ack(s)
            delivered += size
        if app_gap and int(clock.t / app_gap[0]) % 2 == 1:     # idle half the time: app-limited
            cc.on_app_limited()
            nxt = (int(clock.t / app_gap[0]) + 1) * app_gap[0]
            clock.t = min([nxt] + ([acks[0][0]] if acks else []))
            continue
        if cc.can_send(chunk) and cc.send_delay() == 0:
            depart = max(clock.t, link_free) + chunk / rate
            if clock.t > 1.0:
                qdelay.append(depart - clock.t - chunk / rate)
            link_free = depart
            at = depart + rtt
            if ack_every:
                at = math.ceil(at / ack_every) * ack_every
            heapq.heappush(acks, (at, sn, chunk))
            cc.on_send(sn, chunk)
            sn += 1
            continue
        candidates = [acks[0][0]] if acks else []
        if cc.send_delay() > 0:
            candidates.append(clock.t + cc.send_delay())
        clock.t = min(candidates) if candidates else clock.t + 1e-4
    return cc, delivered, qdelay


@pytest.mark.parametrize("rate,rtt", [(12.5e6, 0.002), (125e6, 0.0002), (125e6, 0.02), (1.25e9, 0.001)])
def test_kvflow_congestion_fills_link_with_short_queue(rate, rtt):
    cc, delivered, qdelay = simulate(rate, rtt, duration=3.0)
    assert cc.mode == PROBE_BW
    assert cc.btl_bw == pytest.approx(rate, rel=0.05)
    assert cc.min_rtt == pytest.approx(rtt + CHUNK / rate, rel=0.1)
    assert delivered / 3.0 > 0.9 * rate * (1 - 0.2 / 3)          # ~full link after startup
    # the queue below us stays near a few chunks: a high-priority chunk waits little
    mean_q = sum(qdelay) / len(qdelay)
    assert mean_q < max(4 * CHUNK / rate, 0.5 * rtt)
    assert cc.cwnd <= max(2.6 * rate * (rtt + CHUNK / rate), cc.min_cwnd) + CHUNK


def test_kvflow_congestion_bursty_acks_keep_link_full():
    """Acks released in batches every 40 ms (a loaded host) over a 2 ms path: a window of twice the
    min-RTT BDP runs dry between batches. The ack-aggregation term covers the gap, and stays bounded."""
    rate, rtt, every = 12.5e6, 0.002, 0.04
    cc, delivered, qdelay = simulate(rate, rtt, duration=4.0, ack_every=every)
    assert cc.mode == PROBE_BW
    assert delivered / 4.0 > 0.95 * rate
    assert 0.5 * rate * every < cc.aggregation <= cc.btl_bw * cc.extra_acked_max_s + 1
    assert sum(qdelay) / len(qdelay) < 1.5 * every          # the extra window queues about one batch
    # the same path without the aggregation term leaves the link idle a fifth of the time
    cc0, delivered0, _ = simulate(rate, rtt, duration=4.0, ack_every=every, ack_aggregation_max_s=0.0)
    assert cc0.aggregation == 0
    assert delivered0 / 4.0 < 0.9 * rate


def test_kvflow_congestion_unpaced_queue_would_be_long():
    """Reference for the above: sending without the controller queues everything at the bottleneck."""
    rate, total = 12.5e6, 64 << 20
    # all chunks written at t=0: the last waits total/rate
    assert total / rate > 5.0


def test_kvflow_congestion_app_limited_keeps_estimate():
    cc, _, _ = simulate(125e6, 0.002, duration=3.0, app_gap=(0.2,))
    assert cc.btl_bw == pytest.approx(125e6, rel=0.1)


def test_kvflow_congestion_probe_rtt_and_reset():
    clock = FakeClock()
    cc = CongestionController(clock, chunk_bytes=CHUNK, min_rtt_window_s=1.0, probe_rtt_s=0.1)
    # steady flow with one chunk in flight: rtt 10 ms, never lower afterwards
    for i in range(50):
        cc.on_send(i, CHUNK)
        clock.advance(0.01 if i == 0 else 0.02)
        cc.on_ack(i)
    assert cc.mode == PROBE_RTT or cc.min_rtt == pytest.approx(0.01)
    for i in range(50, 200):
        cc.on_send(i, CHUNK)
        clock.advance(0.02)
        cc.on_ack(i)
    assert cc.min_rtt == pytest.approx(0.02, rel=0.01)     # re-measured after the window expired
    cc.reset()
    assert cc.inflight == 0 and cc.can_send(CHUNK)
    assert cc.on_ack(12345) is None                          # unknown send numbers are ignored


def test_kvflow_congestion_pacing_spaces_chunks():
    clock = FakeClock()
    cc = CongestionController(clock, chunk_bytes=CHUNK)
    cc.btl_bw, cc.min_rtt, cc.mode, cc.pacing_gain, cc.cwnd_gain = 100e6, 0.01, PROBE_BW, 1.0, 2.0
    cc.filled_pipe = True
    cc.on_send(1, CHUNK)
    assert cc.send_delay() == pytest.approx(CHUNK / 100e6, rel=0.01)
    assert cc.can_send(CHUNK)
    clock.advance(CHUNK / 100e6)
    assert cc.send_delay() == 0
    assert cc.cwnd == int(2.0 * 100e6 * 0.01)
    cc.btl_bw = 1e6                      # a tiny BDP: the window never drops below min_cwnd
    assert cc.cwnd == cc.min_cwnd == 2 * CHUNK
    cc.on_send(2, CHUNK)
    assert cc.send_delay() <= 0.02 + 1e-9            # a low estimate slows, never stalls: gap <= 2 min RTT


def test_kvflow_congestion_tiny_first_sample_does_not_stall():
    """A 1-byte app-limited chunk as the very first sample must not pace the next chunk seconds away."""
    clock = FakeClock()
    cc = CongestionController(clock, chunk_bytes=CHUNK)
    cc.on_app_limited()
    cc.on_send(1, 1)
    clock.advance(0.001)
    cc.on_ack(1)
    assert 0 < cc.btl_bw < 10_000
    cc.on_send(2, CHUNK)
    assert cc.send_delay() < 0.001


# ---------------------------------------------------------------------- config and encoding
def test_kvflow_parse_size_and_address():
    assert parse_size("256KiB") == 256 << 10
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("800Mbit") == 100_000_000
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError):
        parse_size("lots")
    assert parse_hostport("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_hostport("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError):
        parse_hostport("nohost")


LOOPBACK = ["--listen", "127.0.0.1:50152"]      # no peer credential needed (the default 0.0.0.0 needs one)


def test_kvflow_config_file_and_flags(tmp_path):
    path = tmp_path / "sidecar.toml"
    path.write_text('''
name = "prefill0"
api = "127.0.0.1:7000"
listen = "0.0.0.0:7001"
chunk-size = "512KiB"
metrics_port = 9400
insecure = true
[peers]
decode0 = "10.0.0.2:7001"
[limits]
max_peer_bytes = "64MiB"
lease_s = 5
''')
    cfg = load_config(["--config", str(path), "--peer", "decode1=10.0.0.3:7001", "--lease-s", "7"])
    assert cfg.name == "prefill0"
    assert cfg.chunk_size == 512 << 10
    assert cfg.peers == {"decode0": "10.0.0.2:7001", "decode1": "10.0.0.3:7001"}
    assert cfg.max_peer_bytes == 64 << 20
    assert cfg.lease_s == 7.0           # the flag wins
    assert cfg.metrics_port == 9400 and cfg.insecure
    bad = tmp_path / "bad.toml"
    bad.write_text('nmae = "x"\n')
    with pytest.raises(ValueError, match="unknown setting"):
        load_config(["--config", str(bad)])
    with pytest.raises(ValueError, match="loopback"):
        load_config(["--api", "0.0.0.0:7000", *LOOPBACK])
    assert load_config(["--api", "0.0.0.0:7000", "--allow-remote-api", *LOOPBACK]).api == "0.0.0.0:7000"
    with pytest.raises(ValueError):
        load_config(["--peer", "nobody", *LOOPBACK])
    with pytest.raises(ValueError):
        load_config(["--chunk-size", "64MiB", *LOOPBACK])
    assert load_config(LOOPBACK).max_chunk_size == 4 << 20
    assert load_config(["--max-chunk-size", "256KiB", *LOOPBACK]).max_chunk_size == 256 << 10
    with pytest.raises(ValueError, match="--max-chunk-size"):
        load_config(["--max-chunk-size", "0", *LOOPBACK])
    assert (load_config(LOOPBACK).peer_transport, load_config(LOOPBACK).data_port) == ("auto", 0)
    assert load_config(["--data-port", "-1", *LOOPBACK]).data_port == -1
    with pytest.raises(ValueError, match="--data-port"):
        load_config(["--data-port", "70000", *LOOPBACK])
    with pytest.raises(SystemExit):     # argparse: not one of the choices
        load_config(["--peer-transport", "udp", *LOOPBACK])


def test_kvflow_chunk_frames_parse_without_copying_their_data():
    import os

    from ciuicflow.kvflow.proto.codec import encode_chunk_frame
    from ciuicflow.kvflow.proto.codec import parse_chunk_frame

    head = pb.Chunk(tid=3, seq=7, sn=99, part=2, offset=4096, crc32c=0xDEADBEEF,
                    info=pb.PartInfo(index=2, nbytes=9999, name="layer.2"))
    for n in (0, 1, 300, 288 << 10):
        data = os.urandom(n)
        buf = bytearray(encode_chunk_frame(head, data))
        frame = parse_chunk_frame(buf)
        reference = pb.PeerFrame.FromString(bytes(buf)).chunk
        assert bytes(frame.data) == reference.data == data
        if n:
            assert frame.data.obj is buf            # a view of the received buffer, not a copy
        reference.data = b""
        assert frame.chunk == reference
    # any field order protobuf allows (here: data before other fields) parses the same
    generic = pb.PeerFrame(chunk=pb.Chunk(tid=1, seq=2, data=b"abc", crc32c=5)).SerializeToString()
    frame = parse_chunk_frame(bytearray(generic))
    assert (frame.chunk.tid, frame.chunk.crc32c, bytes(frame.data)) == (1, 5, b"abc")
    # anything else is left to protobuf (which judges malformed bytes)
    assert parse_chunk_frame(bytearray(b"\x12\x05abc")) is None
    assert parse_chunk_frame(bytearray(pb.PeerFrame(abort=pb.Abort(tid=1)).SerializeToString())) is None
    assert parse_chunk_frame(bytearray(b"\x12\x02\x32\x09")) is None     # data longer than the frame


def test_kvflow_tensor_encoding_roundtrip():
    torch = pytest.importorskip("torch")
    from ciuicflow.kvflow.client.payload import decode_part, encode_part

    values = [torch.randn(3, 5), torch.randn(4, 4, dtype=torch.float64).t(), torch.arange(7, dtype=torch.int8),
              torch.randn(2, 3).to(torch.bfloat16), torch.zeros(0, 8, dtype=torch.float16), torch.tensor(3.5),
              torch.tensor([True, False]), torch.randn(2, 2, dtype=torch.complex64).conj()]
    for i, v in enumerate(values):
        info, mv = encode_part(i, v, name=f"t{i}")
        out = decode_part(info, bytearray(mv))
        assert out.dtype == v.dtype and out.shape == v.shape
        assert torch.equal(out, v.resolve_conj())
    with pytest.raises(TypeError):
        encode_part(0, 3.14)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.floats(1.0, 1e9), st.booleans()), min_size=1, max_size=120))
def test_kvflow_bandwidth_is_the_max_over_the_last_rounds(samples):
    from ciuicflow.kvflow.core.congestion import RateSample
    cc = CongestionController(lambda: 0.0, chunk_bytes=1 << 18)
    taken = []                  # (round, rate) of the samples the estimator keeps
    for advance, rate, app_limited in samples:
        cc.round_count += advance
        before = cc.btl_bw
        cc._update_bw(RateSample(rate, 0.001, app_limited))
        if app_limited and rate < before:
            assert cc.btl_bw == before      # as BBR: a low app-limited sample neither counts nor ages the max
            continue
        taken.append((cc.round_count, rate))
        horizon = cc.round_count - cc.bw_window_rounds
        assert cc.btl_bw == max(r for rnd, r in taken if rnd >= horizon)


def test_kvflow_packed_chunk_spans_and_checks():
    from ciuicflow.kvflow.sidecar.peer_service import check_packed
    from ciuicflow.kvflow.sidecar.store import InChunk, InTransfer

    infos = [pb.PartInfo(index=4 + k, nbytes=n) for k, n in enumerate((5, 0, 3))]
    c = pb.Chunk(tid=1, seq=0, part=4, offset=0, info=infos[0], more=infos[1:])
    assert check_packed(c, 8) is None
    chunk = InChunk(4, 0, b"aaaaabbb", infos[0], 0, 5, c.more)
    assert [(p, o, i.index, s, n) for p, o, i, s, n in chunk.spans()] == [(4, 0, 4, 0, 5), (5, 0, 5, 5, 0),
                                                                         (6, 0, 6, 5, 3)]
    assert chunk.ends_part and chunk.last_part == 6
    entry = InTransfer("k", "a", "u", "normal", "tensors", 60, None)
    entry.chunks.append(chunk)
    assert entry.expected_next() == (7, 0, None)
    # what a receiver refuses
    assert "has 9 bytes" in check_packed(c, 9)
    assert "does not start a part" in check_packed(pb.Chunk(part=4, offset=3, info=infos[0], more=infos[1:]), 8)
    assert "does not start a part" in check_packed(pb.Chunk(part=4, more=infos[1:]), 3)
    skipped = [pb.PartInfo(index=5, nbytes=0), pb.PartInfo(index=7, nbytes=3)]
    assert check_packed(pb.Chunk(part=4, info=infos[0], more=skipped), 8) is not None


def test_kvflow_chunks_grow_with_the_link_rate():
    """A chunk is what the link carries in 20 ms, as --chunk-size doubled, up to 2 MiB and the message limit;
    the cutter applies a new size to parts that start after it."""
    from ciuicflow.kvflow.core.chunking import Cutter, chunk_bytes

    def size(rate_Bps, chunk=256 << 10, limit=2 << 20):
        return chunk_bytes(rate_Bps, chunk, limit)

    assert size(0) == 256 << 10                      # no measurement yet
    assert size(12.5e6) == 256 << 10                 # 100 Mbit/s: 250 KB in 20 ms
    assert size(30e6) == 512 << 10                   # 600 KB in 20 ms
    assert size(1e9) == 2 << 20
    assert size(1e9, limit=64 << 10) == 256 << 10    # a limit below --chunk-size keeps chunks at it
    assert size(1e9, limit=1 << 20) == 1 << 20
    assert size(1e9, chunk=48 << 10) == 1536 << 10   # doubling from an odd chunk size stays under the cap

    cutter = Cutter(256 << 10, 300 << 10)
    part = bytes(range(256)) * 4096                  # 1 MiB
    sizes = []
    for index, link_chunk in enumerate((256 << 10, 512 << 10)):
        cutter.set_peer_chunk(link_chunk)
        info = pb.PartInfo(index=index, nbytes=len(part))
        sizes.append([len(c.data) for c in cutter.feed(pb.SendData(part=index, offset=0, data=part, info=info))])
    assert sizes == [[256 << 10] * 4, [512 << 10] * 2]
    cutter.set_peer_chunk(1 << 20)                   # a part up to the link's chunk goes whole
    info = pb.PartInfo(index=2, nbytes=len(part))
    chunks = cutter.feed(pb.SendData(part=2, offset=0, data=part, info=info))
    assert [len(c.data) for c in chunks] == [1 << 20] and bytes(chunks[0].data) == part
