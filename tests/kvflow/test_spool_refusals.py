"""A receiver's spool that cannot be written (a symlink planted where a transfer's file goes) fails that
transfer with a clear status and one log line; the sidecar does not crash the peer's stream (no INTERNAL,
no reconnect churn), follows no symlink, and goes on with other transfers. Real sidecar processes on
127.0.0.1."""
import hashlib
import os

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from tests.kvflow.raw import RawLink, chunk, open_frame

PEER_A = (("x-ciuic-peer", "a"),)


def _base(source: str, key: str) -> str:
    return hashlib.sha256(f"{source}\0{key}".encode()).hexdigest()


def _refused(b, key: str):
    with pytest.raises(KVFlowError) as err:
        b.client().recv(key, timeout_s=1)
    return err.value


def test_symlink_planted_in_the_spool_fails_its_transfer_once_logged(sidecars, tmp_path):
    spool = tmp_path / "spool"
    a, b = sidecars.pair(b_args=["--spool-dir", str(spool)])
    target = tmp_path / "target"
    target.write_text("precious")
    for key, ext in (("planted-data", ".data"), ("planted-idx", ".idx"), ("planted-meta", ".meta.tmp")):
        (spool / (_base("a", key) + ext)).symlink_to(target)
        for _ in range(3):                      # tried again: refused again, logged once
            with pytest.raises(KVFlowError) as err:
                a.client().send("b", key, b"payload").wait(30)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
            assert "symlink" in str(err.value)
        assert b.log().count(_base("a", key) + ext) == 1, b.log()

    # planted after the transfer's files were made, before its first chunk is written
    with RawLink(b.listen, PEER_A) as link:
        link.send(open_frame("planted-later"))
        assert link.recv().state.error_code == 0
        data = spool / (_base("a", "planted-later") + ".data")
        data.unlink()
        data.symlink_to(target)
        link.send(chunk(b"abc"))
        ack = link.recv().ack
        assert ack.code == pb.ACK_FAILED and ack.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "symlink" in ack.message
        link.send(open_frame("after", tid=2))       # the stream goes on
        assert link.recv().state.error_code == 0
    assert _refused(b, "planted-later").code == grpc.StatusCode.FAILED_PRECONDITION

    # the outcome log: a collected transfer's tombstone cannot be written, its Recv still succeeds
    log = spool / "tombstones.log"
    log.unlink(missing_ok=True)
    log.symlink_to(target)
    for i in range(3):
        a.client().send("b", f"fine-{i}", b"still fine").wait(30)
        assert b.client().recv(f"fine-{i}", timeout_s=10) == b"still fine"
    assert target.read_text() == "precious"
    text = b.log()
    assert text.count("tombstones.log") == 1, text
    assert "Traceback" not in text and "INTERNAL" not in text, text
    assert "link to b lost" not in a.log(), a.log()


def _spool_files(spool, source: str, key: str, payload: bytes, data: bytes) -> str:
    """A complete one-chunk transfer's spool files as a receiver writes them, its data file ``data``."""
    import base64
    import json

    import crc32c
    base = _base(source, key)
    meta = {"key": key, "source": source, "uuid": "u", "priority": "normal", "payload_kind": "bytes",
            "lease_s": 0.0, "total": 1, "num_parts": 1, "complete": True}
    info = base64.b64encode(pb.PartInfo(index=0, nbytes=len(payload)).SerializeToString()).decode()
    (spool / f"{base}.meta").write_text(json.dumps(meta))
    (spool / f"{base}.idx").write_text(json.dumps([0, 0, 0, len(payload), crc32c.crc32c(payload), len(payload),
                                                   info]) + "\n")
    (spool / f"{base}.data").write_bytes(data)
    for ext in (".meta", ".idx", ".data"):
        os.chmod(spool / f"{base}{ext}", 0o600)
    return base


def test_symlinks_planted_in_the_spool_are_refused_on_restore(sidecars, tmp_path):
    """On restart: a symlinked outcome log, its rewrite's temporary file and a transfer whose rewrite
    meets a symlink are refused (logged once each); the sidecar starts, holds nothing it could not
    restore, and serves."""
    spool = tmp_path / "spool"
    a, b = sidecars.pair(b_args=["--spool-dir", str(spool)])
    target = tmp_path / "target"
    target.write_text("precious")
    a.client().send("b", "kept", b"kept here").wait(30)
    b.kill9()
    (spool / "tombstones.log").write_text('["a", "old", "collected", "u"]\n')
    (spool / "tombstones.log.tmp").symlink_to(target)
    base = _spool_files(spool, "a", "torn", b"hello", b"hel")    # a torn chunk: its files are rewritten
    (spool / f"{base}.meta.tmp").symlink_to(target)
    b.restart()
    assert b.client().recv("kept", timeout_s=10) == b"kept here"
    assert _refused(b, "torn").code == grpc.StatusCode.DEADLINE_EXCEEDED
    text = b.log()
    assert text.count("tombstones.log.tmp") == 1 and text.count(f"{base}.meta.tmp") == 1, text
    assert "Traceback" not in text, text
    assert target.read_text() == "precious"
    assert b.client().stats()["memory"]["used"] == 0
