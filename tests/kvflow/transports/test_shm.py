"""Shared-memory handoff between a client and its sidecar (/dev/shm): the same bytes as in-band, the
fallback to in-band bytes, refusal of foreign paths, back-pressure, and no files left behind."""
import glob
import os
import random
import threading
import time

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.proto import shm as shmlib
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.proto.codec import encode_chunk_frame
from ciuicflow.testing.kvflow_faults import Faults

CHUNK = 64 << 10

pytestmark = pytest.mark.skipif(not shmlib.available(), reason="no writable /dev/shm")


def our_files():
    return sorted(glob.glob(os.path.join(shmlib.shm_dir(), f"{shmlib.PREFIX}{os.getpid()}-*")))


@pytest.fixture
def pair(sidecars):
    return sidecars.pair(a_args=["--chunk-size", str(CHUNK)], b_args=["--chunk-size", str(CHUNK)])


def test_shm_used_and_bytes_intact(pair):
    a, b = pair
    ca, cb = a.client(), b.client()
    assert ca._use_shm() and cb._use_shm()
    payload = os.urandom(3 * CHUNK + 17)
    ca.send("b", "s-1", payload).wait(30)
    assert cb.recv("s-1", timeout_s=10) == payload
    torch = pytest.importorskip("torch")
    tensors = [torch.randn(3, 5000), torch.arange(10, dtype=torch.int16), torch.empty(0), torch.randn(700, 300)]
    ca.send("b", "s-2", tensors + [b"tail", b""]).wait(30)
    got = cb.recv("s-2", timeout_s=10)
    for x, y in zip(tensors, got[:4]):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    assert got[4:] == [b"tail", b""]
    with ca.open("b", "s-3", payload_kind="bytes") as stream:
        for i in range(20):
            stream.append(bytes([i]) * (CHUNK // 3 + i))
    stream.handle.wait(30)
    parts = [p.value for p in cb.recv_stream("s-3", timeout_s=10)]
    assert parts == [bytes([i]) * (CHUNK // 3 + i) for i in range(20)]
    time.sleep(0.2)
    assert our_files() == []


def test_shm_and_inband_clients_interoperate(pair):
    """A sender in shared memory, a receiver in-band, and the other way round."""
    a, b = pair
    payload = os.urandom(2 * CHUNK + 5)
    a.client(shm=True).send("b", "mix-1", payload).wait(30)
    assert b.client(shm=False).recv("mix-1", timeout_s=10) == payload
    a.client(shm=False).send("b", "mix-2", payload).wait(30)
    assert b.client(shm=True).recv("mix-2", timeout_s=10) == payload
    assert our_files() == []


def test_sidecar_without_shm_falls_back_in_band(sidecars):
    a, b = sidecars.pair(a_args=["--no-local-shm"], b_args=["--no-local-shm"])
    ca, cb = a.client(), b.client()
    assert not ca._use_shm()
    payload = os.urandom(100_000)
    ca.send("b", "nb-1", payload).wait(30)
    assert cb.recv("nb-1", timeout_s=10) == payload
    with pytest.raises(KVFlowError) as exc:
        a.client(shm=True).send("b", "nb-2", payload)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # a client that hands over a file anyway is refused, explicitly
    req = [pb.SendRequest(header=pb.SendHeader(dest="b", key="nb-3", payload_kind="bytes")),
           pb.SendRequest(data=pb.SendData(part=0, offset=0, info=pb.PartInfo(index=0, nbytes=10),
                                           shm=pb.ShmRef(path="/dev/shm/ciuicflow-kv-x", offset=0, length=10))),
           pb.SendRequest(end=pb.SendEnd(num_parts=1))]
    with pytest.raises(grpc.RpcError) as rpc:
        ca._stub.Send(iter(req), metadata=ca._metadata(False), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert our_files() == []


def _probe(client, path, nonce=b"0123456789abcdef"):
    return client._stub.ShmProbe(pb.ShmProbeRequest(path=path, nonce=nonce), metadata=client._metadata(False),
                                 timeout=10)


def test_probe_refuses_foreign_paths(pair):
    a, _ = pair
    ca = a.client()
    secret = "00" * shmlib.SECRET_BYTES
    for path in ("/etc/passwd", "/dev/shm/../etc/passwd", "/tmp/ciuicflow-kv-x",
                 os.path.join(shmlib.shm_dir(), "other-name"), f"/etc/passwd#{secret}",
                 f"{shmlib.shm_dir()}/../etc/{shmlib.PREFIX}x#{secret}", "fd:0123", "fd:" + "ab" * 16):
        r = _probe(ca, path)
        assert not r.ok and "refused" in r.message, path
    # a symlink with the right name is not followed
    link = os.path.join(shmlib.shm_dir(), f"{shmlib.PREFIX}{os.getpid()}-link")
    os.symlink("/etc/hostname", link)
    try:
        assert not _probe(ca, f"{link}#{secret}").ok
    finally:
        os.unlink(link)
    # descriptor paths are not accepted any more, whatever they lead to (and the answer does not say)
    fd, path = shmlib.create("t")
    try:
        os.write(fd, b"0123456789abcdef" + bytes(4 * shmlib.PAGE))
        good = shmlib.named_ref(path, shmlib.new_secret(fd))
        for proc_path in (f"/proc/{os.getpid()}/fd/{fd}", "/proc/1/root/etc/passwd"):
            r = _probe(ca, proc_path)
            assert not r.ok and path not in r.message and "/etc" not in r.message
        assert not _probe(ca, path).ok                              # the name without its secret
        assert not _probe(ca, shmlib.named_ref(path, os.urandom(shmlib.SECRET_BYTES))).ok     # a guessed one
        assert not _probe(ca, good, nonce=b"0").ok                  # no short nonces (no guessing byte by byte)
        assert _probe(ca, good).ok                                  # the file, its secret, its content
        os.pwrite(fd, b"something else!!", 0)
        r = _probe(ca, good)                                        # wrong content: another host or namespace
        assert not r.ok and "differs" in r.message
    finally:
        shmlib.unlink(path)
        os.close(fd)


def test_send_shm_path_outside_dir_is_refused(pair):
    a, _ = pair
    ca = a.client()
    req = [pb.SendRequest(header=pb.SendHeader(dest="b", key="bad-1", payload_kind="bytes")),
           pb.SendRequest(data=pb.SendData(part=0, offset=0, info=pb.PartInfo(index=0, nbytes=10),
                                           shm=pb.ShmRef(path="/etc/passwd", offset=0, length=10))),
           pb.SendRequest(end=pb.SendEnd(num_parts=1))]
    with pytest.raises(grpc.RpcError) as rpc:
        ca._stub.Send(iter(req), metadata=ca._metadata(True), timeout=10)
    assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # a handle past the end of the file, or without a ring size, or longer than its ring
    for k, (ring, length) in enumerate(((1 << 20, 10), (0, 10), (8, 10))):
        fd, path = shmlib.create("t")       # the sidecar unlinks it once open: a new one each time
        try:
            os.write(fd, b"abc")
            path = shmlib.named_ref(path, shmlib.new_secret(fd))
            req[0] = pb.SendRequest(header=pb.SendHeader(dest="b", key=f"bad-2-{k}", payload_kind="bytes"))
            req[1] = pb.SendRequest(data=pb.SendData(part=0, offset=0, info=pb.PartInfo(index=0, nbytes=10),
                                                     shm=pb.ShmRef(path=path, offset=0, length=length,
                                                                   ring_bytes=ring)))
            with pytest.raises(grpc.RpcError) as rpc:
                ca._stub.Send(iter(req), metadata=ca._metadata(False), timeout=10)
            assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            shmlib.unlink(path)
            os.close(fd)

def test_no_shm_files_left_after_failures(sidecars):
    """Failed sends (unknown peer, sidecar killed mid-transfer), a cancelled receive and an abandoned
    stream leave nothing in /dev/shm."""
    a, b = sidecars.pair(a_args=["--chunk-size", str(CHUNK)], b_args=Faults(link_rate=2_000_000).flags())
    ca, cb = a.client(), b.client()
    with pytest.raises(KVFlowError):
        ca.send("nobody", "f-1", os.urandom(1000)).wait(10)
    stream = cb.recv_stream("never", timeout_s=0.3)
    with pytest.raises(KVFlowError):
        list(stream)
    rs = cb.recv_stream("never-2", timeout_s=30)
    rs.cancel()
    h = ca.send("b", "f-2", os.urandom(8 << 20))
    time.sleep(0.5)
    a.kill9()
    with pytest.raises(KVFlowError):
        h.wait(30)
    time.sleep(0.3)
    assert our_files() == []


def test_rings_wrap_and_a_slow_reader_holds_the_sidecar(sidecars):
    """Both rings (1 MiB here) wrap many times; the sidecar writes into the receiving client's ring only
    as far as the client has read, and a chunk larger than that ring goes in-band."""
    a, b = sidecars.pair(a_args=["--chunk-size", "2MiB"])
    ca, cb = a.client(shm_window_bytes=1 << 20), b.client(shm_recv_ring_bytes=1 << 20)
    rng = random.Random(5)
    parts = [os.urandom(rng.choice((1, 4095, 4097, 100_003, 777_777, 1 << 20))) for _ in range(24)]
    parts.insert(7, os.urandom((3 << 20) + 5))             # a 2 MiB chunk: more than the receiving ring
    ca.send("b", "ring-1", parts).wait(60)
    got = []
    for part in cb.recv_stream("ring-1", timeout_s=60):     # everything is there: the ring fills at once
        got.append(part.value)
        time.sleep(0.01)
    assert len(got) == len(parts) and all(x == y for x, y in zip(got, parts))
    time.sleep(0.2)
    assert our_files() == []


def test_shm_backpressure_bounds_unread_bytes(sidecars, tmp_path):
    """The client writes at most its window ahead of what the sidecar has read."""
    a, b = sidecars.pair(a_args=["--max-peer-bytes", str(1 << 20), "--max-total-bytes", str(1 << 20),
                                 "--chunk-size", str(CHUNK)],
                         b_args=Faults(link_rate=4_000_000).flags() + ["--spool-dir", str(tmp_path / "spool")])
    ca = a.client(shm_window_bytes=1 << 20)
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for f in our_files():
                try:
                    peak[0] = max(peak[0], os.stat(f).st_blocks * 512)
                except FileNotFoundError:
                    pass
            time.sleep(0.005)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    t0 = time.monotonic()
    with ca.open("b", "bp-shm", payload_kind="bytes") as stream:
        for _ in range(24):
            stream.append(os.urandom(128 << 10))       # 3 MiB over a 4 MB/s link
    appended = time.monotonic() - t0
    stream.handle.wait(30)
    stop.set()
    th.join()
    assert appended > 0.2
    assert peak[0] <= (1 << 20) + (256 << 10)
    assert len(b.client().recv("bp-shm", timeout_s=10)) == 3 << 20


def test_encode_chunk_frame_matches_protobuf():
    for n in (0, 1, 127, 128, 300, 70_000):
        data = os.urandom(n)
        for info in (None, pb.PartInfo(index=2, nbytes=n, name="a")):
            c = pb.Chunk(tid=7, seq=300, sn=1 << 40, part=2, offset=9, crc32c=0xFFFFFFFF, info=info)
            ref = pb.PeerFrame(chunk=pb.Chunk(tid=7, seq=300, sn=1 << 40, part=2, offset=9, crc32c=0xFFFFFFFF,
                                              info=info, data=data))
            assert pb.PeerFrame.FromString(encode_chunk_frame(c, data)) == ref
            assert pb.PeerFrame.FromString(encode_chunk_frame(c, memoryview(data))) == ref



def test_small_parts_are_packed_and_arrive_whole(pair):
    """Layers read together from shared memory share chunks; every part arrives whole, in order, through
    shared memory and in-band alike."""
    torch = pytest.importorskip("torch")
    a, b = pair
    torch.manual_seed(0)
    tensors = [torch.randn(3 + 7 * i, 37) for i in range(61)]       # 444 B .. 63 KB, odd sizes
    tensors[30] = torch.empty(0, 37)                                # an empty layer: goes in-band
    tensors[40] = torch.randn(1000, 300)                            # 1.2 MB: cut into 19 chunks of 64 KiB
    # Chunks are packed up to what the link carries in 20 ms: one chunk size until a first transfer has
    # measured the link, then (on loopback) --whole-part-bytes, 1 MiB.
    first = a.client().send("b", "packed-first", tensors[:20]).wait(30)
    assert first.chunks < 20
    for shm in (True, False):
        result = a.client().send("b", f"packed-{shm}", tensors).wait(30)
        assert result.chunks < 40            # unpacked: 60 parts of one chunk each + 19 for the big one
        parts = list(b.client(shm=shm).recv_stream(f"packed-{shm}", timeout_s=10))
        assert [p.index for p in parts] == list(range(61))
        for x, p in zip(tensors, parts):
            assert p.value.dtype == x.dtype and p.value.shape == x.shape and torch.equal(p.value, x)
    assert our_files() == []


def test_rings_are_named_by_descriptor_and_reused(pair):
    """Where the sidecar takes this process's descriptors (its Unix socket), rings are unlinked at once,
    handed over, and kept for the next transfers (no fresh tmpfs pages); a ring of a transfer that did not
    end well is not kept."""
    a, b = pair
    ca, cb = a.client(), b.client()
    assert ca._use_shm() and cb._use_shm() and ca._rings.by_fd and cb._rings.by_fd
    sizes = (5 * CHUNK + 3, 2 << 20, 17)
    used = set()
    for i, n in enumerate(sizes * 2):
        payload = os.urandom(n)
        ca.send("b", f"pool-{i}", [payload[:n // 2], payload[n // 2:]]).wait(30)
        assert b"".join(cb.recv(f"pool-{i}", timeout_s=10)) == payload
        assert our_files() == []            # never a name in /dev/shm
        used |= {fd for idle in (ca._rings._idle, cb._rings._idle) for rings in idle.values() for fd, *_ in rings}
    assert len(ca._rings._idle[("s", ca.shm_window_bytes)]) == 1      # one send ring, used six times
    assert len(cb._rings._idle[("r", cb.shm_recv_ring_bytes)]) == 1
    assert len(used) == 2
    # a receive that is given up (the transfer is not there) does not keep its ring
    with pytest.raises(KVFlowError):
        cb.recv("absent", timeout_s=0.3)
    assert len(cb._rings._idle[("r", cb.shm_recv_ring_bytes)]) == 0
    ca.close()
    cb.close()
    assert ca._rings._idle == {} and cb._rings._idle == {}


def test_rings_by_name_when_descriptors_are_not_possible(pair):
    """The fallback where the sidecar's descriptor socket is out of reach (another user or mount
    namespace): named files with a secret, one per transfer, unlinked once both sides hold them."""
    a, b = pair
    ca, cb = a.client(), b.client()
    for c in (ca, cb):
        assert c._probe_shm_file(by_fd=False)[0]
        c._shm_ok = True
        assert not c._rings.by_fd
    payload = os.urandom(3 * CHUNK + 1)
    ca.send("b", "named-1", payload).wait(30)
    assert cb.recv("named-1", timeout_s=10) == payload
    assert ca._rings._idle == {} and cb._rings._idle == {}
    time.sleep(0.2)
    assert our_files() == []
