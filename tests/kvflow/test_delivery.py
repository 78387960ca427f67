"""Delivery guarantees (docs/kvflow.md): OK survives a receiver restart (kept at the sender without spool,
durable with one), idempotency keys prevent a second delivery after the sending sidecar restarts, explicit
acknowledgement redelivers to a consumer that died, expired or dropped transfers are never acknowledged
and release their bytes, a Send that never ends or a reader that never reads cannot pin memory, and the
spool is private, follows no symlink, is fsynced and is not trusted on restore."""
import json
import os
import time

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from tests.kvflow.sidecars import wait_until
from tests.kvflow.raw import RawLink, chunk, open_frame

PEER_A = (("x-ciuic-peer", "a"),)


def test_ok_without_spool_survives_a_receiver_restart(sidecars):
    """The receiver keeps it in memory only: the sender keeps it too until the consumer has it, and sends it
    again to a receiver that restarted and lost it."""
    a, b = sidecars.pair()
    payload = os.urandom(3 << 20)
    a.client().send("b", "d-1", payload).wait(30)           # OK
    small = {f"d-{i}": os.urandom(100_000 + i) for i in range(2, 30)}
    for h in [a.client().send("b", k, v) for k, v in small.items()]:
        h.wait(30)
    assert a.stats()["peers"]["b"]["retained"] == 29
    b.restart()                                              # kill -9: b's memory is gone
    assert b.client().recv("d-1", timeout_s=30) == payload
    for k, v in small.items():
        assert b.client().recv(k, timeout_s=30) == v
    wait_until(lambda: a.stats()["peers"]["b"]["retained"] == 0 and a.stats()["memory"]["used"] == 0,
               what="the sender let it go once its consumer had it")


def test_ok_with_spool_is_durable_and_not_kept_by_the_sender(sidecars, tmp_path):
    a, b = sidecars.pair(b_args=["--spool-dir", str(tmp_path / "spool")])
    payload = os.urandom(3 << 20)
    a.client().send("b", "d-2", payload).wait(30)
    assert a.stats()["peers"]["b"]["retained"] == 0 and a.stats()["memory"]["used"] == 0
    b.restart()
    assert b.client().recv("d-2", timeout_s=30) == payload
    modes = {name: os.stat(tmp_path / "spool" / name).st_mode & 0o777 for name in os.listdir(tmp_path / "spool")}
    assert modes and set(modes.values()) == {0o600}, modes
    assert os.stat(tmp_path / "spool").st_mode & 0o777 == 0o700


def test_spool_syncs_before_it_acknowledges(tmp_path, monkeypatch):
    """A chunk is on disk (fdatasync) before the peer service acknowledges it; a completed transfer's
    record too (fsync of the file and of the directory)."""
    from ciuicflow.kvflow.sidecar import spool as spool_mod
    from ciuicflow.kvflow.sidecar.store import InChunk, InTransfer
    synced = []
    monkeypatch.setattr(spool_mod.os, "fdatasync", lambda fd: synced.append(("data", fd)))
    monkeypatch.setattr(spool_mod.os, "fsync", lambda fd: synced.append(("full", fd)))
    sp = spool_mod.Spool(str(tmp_path / "spool"))
    entry = InTransfer("k", "a", "u", "normal", "bytes", 0.0, None)
    sp.create(entry)
    synced.clear()
    c = InChunk(0, 0, b"data", pb.PartInfo(index=0, nbytes=4), 0, 4)
    entry.chunks.append(c)
    sp.append(entry, c)
    assert [kind for kind, _ in synced] == ["data", "data"]       # the data and its index record
    synced.clear()
    entry.complete = True
    sp.complete(entry)
    assert [kind for kind, _ in synced] == ["full", "full"]       # the record, then the directory


def test_spool_must_be_private_and_follows_no_symlink(sidecars, tmp_path):
    from ciuicflow.kvflow.sidecar.spool import Spool
    shared = tmp_path / "shared"            # another user's
    shared.mkdir(mode=0o755)
    os.chown(shared, 65534, 65534)
    with pytest.raises(PermissionError):
        Spool(str(shared))
    mine = tmp_path / "mine"                # this user's, open to others (as sidecars before made them)
    mine.mkdir(mode=0o755)
    mine.chmod(0o755)
    Spool(str(mine))
    assert os.stat(mine).st_mode & 0o777 == 0o700
    link = tmp_path / "link"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link.symlink_to(private)
    with pytest.raises(PermissionError):
        Spool(str(link))
    # a symlink planted where a transfer's file will be: not written through
    sp = Spool(str(private))
    from ciuicflow.kvflow.sidecar.store import InTransfer
    entry = InTransfer("k", "a", "u", "normal", "bytes", 0.0, None)
    target = tmp_path / "target"
    target.write_text("precious")
    (private / (sp.base(entry) + ".data")).symlink_to(target)
    with pytest.raises(OSError):
        sp.create(entry)
    assert target.read_text() == "precious"
    b = sidecars.make("b", args=["--spool-dir", str(shared)])
    b.start()
    with pytest.raises(RuntimeError):
        b.wait_ready(20)


def _spool_entry(d, source, key, meta_over=None, chunks=((0, b"hello"),), data=None, legacy=False, mode=0o600):
    """Spool files as a receiver would write them, with fields replaced by ``meta_over`` (``legacy``: named
    as sidecars before keys were scoped by source named them)."""
    import base64
    import hashlib
    import crc32c
    base = hashlib.sha256((key if legacy else f"{source}\0{key}").encode()).hexdigest()
    meta = {"key": key, "source": source, "uuid": "u", "priority": "normal", "payload_kind": "bytes",
            "lease_s": 0.0, "total": len(chunks), "num_parts": len(chunks), "complete": True, **(meta_over or {})}
    (d / f"{base}.meta").write_text(json.dumps(meta))
    lines, blob = [], b""
    for seq, (part, payload) in enumerate(chunks):
        info = base64.b64encode(pb.PartInfo(index=part, nbytes=len(payload)).SerializeToString()).decode()
        lines.append(json.dumps([seq, part, 0, len(payload), crc32c.crc32c(payload), len(payload), info]))
        blob += payload
    (d / f"{base}.idx").write_text("\n".join(lines) + "\n")
    (d / f"{base}.data").write_bytes(blob if data is None else data)
    for ext in (".meta", ".idx", ".data"):
        os.chmod(d / f"{base}{ext}", mode)
    return base


def _kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_spool_contents_are_checked_on_restore(sidecars, tmp_path):
    """Bogus fields, out-of-order records and files larger than the cap are dropped before they are held
    (a huge one is never read); good entries are restored; the sidecar serves on."""
    d = tmp_path / "spool"
    d.mkdir(mode=0o700)
    d.chmod(0o700)
    _spool_entry(d, "a", "good")
    _spool_entry(d, "a", "bad-priority", {"priority": "urgent"})
    _spool_entry(d, "a", "bad-lease", {"lease_s": "forever"})
    _spool_entry(d, "a b", "bad-source")
    _spool_entry(d, "a", "bad-kind", {"payload_kind": "pickles"})
    _spool_entry(d, "a", "out-of-order", chunks=((1, b"xx"), (0, b"yy")))
    huge = 200 << 20                     # a sparse data file: declared in the index, never to be read
    base = _spool_entry(d, "a", "huge", chunks=((0, b"h"),))
    import base64
    info = base64.b64encode(pb.PartInfo(index=0, nbytes=huge).SerializeToString()).decode()
    (d / f"{base}.idx").write_text(json.dumps([0, 0, 0, huge, 0, huge, info]) + "\n")
    with open(d / f"{base}.data", "wb") as fh:
        fh.truncate(huge)
    b = sidecars.make("b", args=["--spool-dir", str(d), "--max-total-bytes", "32MiB", "--max-peer-bytes", "32MiB",
                                 "--allow-unknown-peers"])
    sidecars.start_all(b)
    assert _kib(b.proc.pid, "VmHWM") < 150 << 10          # the 200 MiB file was not read
    cb = b.client()
    st = cb.stats()["store"]
    assert set(st["keys"]) <= {"good", "out-of-order"} and st["complete"] == 1, st    # not the bogus ones
    assert cb.recv("good", timeout_s=5) == b"hello"
    with pytest.raises(KVFlowError):            # its records out of order: kept as nothing, not complete
        cb.recv("out-of-order", timeout_s=1)
    assert cb.stats()["memory"]["used"] == 0


def test_spool_of_an_older_sidecar_is_restored(sidecars, tmp_path):
    """Upgrading: a spool directory and files made with the umask, named by key alone, are taken over
    (made private, renamed) rather than dropped."""
    d = tmp_path / "spool"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    old = _spool_entry(d, "a", "from-before", legacy=True, mode=0o644)
    b = sidecars.make("b", args=["--spool-dir", str(d), "--allow-unknown-peers"])
    sidecars.start_all(b)
    assert b.client().recv("from-before", timeout_s=5, source="a") == b"hello"
    assert not any(name.startswith(old) for name in os.listdir(d))
    assert os.stat(d).st_mode & 0o777 == 0o700


def test_idempotency_key_prevents_a_second_delivery(sidecars, tmp_path):
    """The consumer has it; the sending sidecar dies before its client knows, and the client tries again
    with the same idempotency key: nothing is delivered twice (also across a restart of a receiver with
    spool)."""
    a, b = sidecars.pair(b_args=["--spool-dir", str(tmp_path / "spool")])
    payload = os.urandom(1 << 20)
    a.client().send("b", "i-1", payload, idempotency_key="req-42").wait(30)
    assert b.client().recv("i-1", timeout_s=10) == payload
    a.restart()
    b.restart()
    r = a.client().send("b", "i-1", payload, idempotency_key="req-42").wait(30)
    assert r.resumed_chunks == r.chunks                      # the receiver had it collected: nothing sent
    with pytest.raises(KVFlowError) as err:
        b.client().recv("i-1", timeout_s=1.5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    a.client().send("b", "i-1", b"a new transfer").wait(30)  # without a key: a new transfer of the key
    assert b.client().recv("i-1", timeout_s=10) == b"a new transfer"


def test_manual_ack_redelivers_until_acknowledged(sidecars):
    a, b = sidecars.pair()
    payload = os.urandom(300_000)
    a.client().send("b", "m-1", payload).wait(30)
    cb = b.client()
    assert cb.recv("m-1", timeout_s=10, manual_ack=True) == payload     # the consumer dies before ack
    assert b.client().recv("m-1", timeout_s=10, manual_ack=True) == payload   # delivered again
    assert a.stats()["peers"]["b"]["retained"] == 1                     # not collected yet: still kept
    b.client().ack("m-1")
    b.client().ack("m-1")                                               # twice is fine
    with pytest.raises(KVFlowError) as err:
        cb.recv("m-1", timeout_s=1)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: a.stats()["peers"]["b"]["retained"] == 0, what="the sender let it go")
    with pytest.raises(KVFlowError) as err:
        cb.ack("never-sent")
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_a_dropped_open_transfer_is_not_acknowledged(sidecars):
    """A transfer in progress whose lease ran out is dropped: its later chunks and its commit are refused,
    and nothing of it stays reserved."""
    b = sidecars.make("b", args=["--allow-unknown-peers", "--lease-s", "0.5"])
    sidecars.start_all(b)
    with RawLink(b.listen, PEER_A) as link:
        link.send(open_frame("slow"))
        link.recv()
        link.send(chunk(b"x" * 1000, seq=0, info=pb.PartInfo(index=0, nbytes=1000)))
        assert link.recv().ack.code == pb.ACK_OK
        time.sleep(1.5)
        link.send(chunk(b"y" * 1000, seq=1, info=pb.PartInfo(index=1, nbytes=1000)))
        assert link.recv().ack.code == pb.ACK_FAILED
        link.send(pb.PeerFrame(commit=pb.Commit(tid=1, total_chunks=2, num_parts=2)))
        assert link.recv().commit.error_code != 0
    assert b.client().stats()["memory"]["used"] == 0


def _commit(link, tid, total_chunks, num_parts):
    link.send(pb.PeerFrame(commit=pb.Commit(tid=tid, total_chunks=total_chunks, num_parts=num_parts)))


def test_a_commit_inconsistent_with_what_was_sent_is_refused(sidecars):
    """A Commit never discards chunks that were sent and held, nor changes an earlier Commit: zero parts
    after a held chunk, fewer chunks than held, or a second Commit that differs fail the transfer
    (INVALID_ARGUMENT) instead of completing it with less than was sent. An empty transfer still completes."""
    b = sidecars.make("b", args=["--allow-unknown-peers"])
    sidecars.start_all(b)
    with RawLink(b.listen, PEER_A) as link:
        for tid, key, chunks, commits in ((1, "zero", 1, [(0, 0)]), (2, "fewer", 2, [(1, 1)]),
                                          (3, "changed", 1, [(2, 2), (1, 1)])):
            link.send(open_frame(key, tid=tid))
            assert link.recv().state.error_code == 0
            for seq in range(chunks):
                link.send(chunk(b"abc", tid=tid, seq=seq))
                assert link.recv().ack.code == pb.ACK_OK
            for total, parts in commits[:-1]:
                _commit(link, tid, total, parts)           # more chunks to come: no answer yet
            _commit(link, tid, *commits[-1])
            reply = link.recv().commit
            assert reply.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], (key, reply)
            with pytest.raises(KVFlowError) as err:
                b.client().recv(key, timeout_s=5)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, key
        link.send(open_frame("empty", tid=4))
        link.recv()
        _commit(link, 4, 0, 0)
        assert link.recv().commit.error_code == 0
    assert b.client().recv("empty", timeout_s=5) == b""
    assert b.client().stats()["memory"]["used"] == 0


def test_a_send_that_never_ends_is_given_up(sidecars):
    """A local sender that stops without ending its transfer: it fails after the stall timeout, its bytes
    are released on both sides, and the FIFO transfers behind it go."""
    a, b = sidecars.pair(a_args=["--stall-timeout-s", "2"])
    ca = a.client(flow=False)
    stream = ca.open("b", "never-ends", payload_kind="bytes")
    stream.append(os.urandom(100_000))
    time.sleep(1.0)
    behind = ca.send("b", "behind", b"fifo, after it")       # waits behind it (FIFO), not for ever
    with pytest.raises(KVFlowError) as err:
        stream.handle.wait(10)
    assert err.value.code == grpc.StatusCode.CANCELLED
    behind.wait(10)
    assert b.client().recv("behind", timeout_s=5) == b"fifo, after it"
    wait_until(lambda: a.stats()["memory"]["used"] == 0 and b.stats()["memory"]["used"] == 0,
               what="the memory of the abandoned transfer released")


def test_a_reader_that_never_reads_does_not_defeat_the_lease(sidecars):
    a, b = sidecars.pair(b_args=["--lease-s", "1"])
    a.client().send("b", "unread", os.urandom(16 << 20)).wait(30)
    # a Recv that takes the first message and then reads nothing (gRPC flow control holds the sidecar)
    with grpc.insecure_channel(b.api) as ch:
        call = ch.unary_stream("/ciuicflow.kvflow.v1.KVFlow/Recv", request_serializer=pb.RecvRequest.SerializeToString,
                               response_deserializer=pb.RecvReply.FromString)
        replies = call(pb.RecvRequest(key="unread", timeout_s=60), metadata=b.api_metadata(), timeout=60)
        assert next(replies).HasField("header")
        wait_until(lambda: b.stats()["memory"]["used"] == 0, timeout=10, what="the lease ended the stalled Recv")
        replies.cancel()
    assert b.stats()["store"]["expired"] == 1


@pytest.mark.parametrize("shm", [False, True])
def test_a_recv_the_sidecar_ends_gets_its_status_at_once(sidecars, shm):
    """A Recv waiting on a stalled transfer, ended by the sidecar at the transfer's lease: the client hears
    why at once (ABORTED), not at its own deadline, and the transfer's memory is released."""
    b = sidecars.make("b", args=["--allow-unknown-peers", "--lease-s", "1"])
    sidecars.start_all(b)
    with RawLink(b.listen, PEER_A) as link:
        link.send(open_frame("stalled"))
        link.recv()
        link.send(chunk(b"x" * 1000, seq=0, info=pb.PartInfo(index=0, nbytes=1000)))
        link.send(chunk(b"y" * 10, seq=1, info=pb.PartInfo(index=1, nbytes=2000)))    # its part never ends
        assert link.recv().ack.code == pb.ACK_OK and link.recv().ack.code == pb.ACK_OK
        t0 = time.monotonic()
        stream = b.client(shm=shm).recv_stream("stalled", timeout_s=30)
        assert next(stream).index == 0
        with pytest.raises(KVFlowError) as err:
            next(stream)
        waited = time.monotonic() - t0
        assert err.value.code == grpc.StatusCode.ABORTED and "made no progress" in str(err.value)
        assert waited < 5, waited           # the lease (1 s) and a sweep, not the client's 30 s
        wait_until(lambda: b.stats()["memory"]["used"] == 0, timeout=10, what="the stalled transfer released")


def test_a_cancelled_send_is_settled_once(sidecars):
    """A local client that cancels its Send while the transfer is on its way (all of it ingested): the
    transfer fails once, cleanly (before: the cancelled outcome was set again, and the sidecar logged an
    InvalidStateError instead of answering), and its memory is released."""
    from ciuicflow.testing.kvflow_faults import Faults
    a, b = sidecars.pair(b_args=Faults(link_rate=2_000_000).flags())
    handle = a.client().send("b", "cancel-me", os.urandom(2 << 20))
    time.sleep(0.5)
    handle.cancel()
    with pytest.raises(KVFlowError):
        handle.wait(10)
    wait_until(lambda: a.stats()["memory"]["used"] == 0, what="the cancelled transfer released")
    a.client().send("b", "after-cancel", b"ok").wait(30)
    assert b.client().recv("after-cancel", timeout_s=10) == b"ok"
    assert "InvalidStateError" not in a.log()
