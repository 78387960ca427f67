"""Faults between real sidecars: kill -9 of a peer mid-transfer then restart (resume), checksum corruption
(retransmit, or DATA_LOSS when it never stops)."""
import hashlib
import os
import time

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.testing.kvflow_faults import Faults

RATE = 8_000_000


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def wait_until(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def received_bytes(sidecar) -> int:
    try:
        return sidecar.stats()["store"]["bytes"]
    except KVFlowError:
        return 0


@pytest.mark.parametrize("spool", [True, False], ids=["spool", "memory"])
def test_kvflow_receiver_killed_mid_transfer_then_restarted(sidecars, tmp_path, spool):
    b_args = Faults(link_rate=RATE).flags()
    if spool:
        b_args += ["--spool-dir", str(tmp_path / "spool")]
    a, b = sidecars.pair(a_args=["--resume-timeout-s", "30"], b_args=b_args)
    ca = a.client()
    payload = os.urandom(6 << 20)                    # ~0.8 s on the link
    handle = ca.send("b", "resume-1", payload, priority="normal")
    wait_until(lambda: received_bytes(b) > (1 << 20), what="the first MiB at b")
    b.kill9()
    time.sleep(0.5)
    assert not handle.done()                         # the sender waits for the peer to come back
    b.restart()
    result = handle.wait(60)
    got = b.client().recv("resume-1", timeout_s=30)
    assert sha(got) == sha(payload)
    assert a.client().stats()["peers"]["b"]["connects"] >= 2
    if spool:
        # resumed from the last acknowledged chunk: what b had spooled (over 1 MiB) was not sent again
        # (chunks are 256 KiB parts, or four of them packed once the link's rate is known)
        assert result.resumed_chunks * (len(payload) // result.chunks) >= 1 << 20
        assert "restored 1 transfer" in b.log()
    else:
        assert result.resumed_chunks == 0            # b lost everything; a still had it all


def test_kvflow_sender_killed_mid_transfer_then_retried_with_resume(sidecars):
    a, b = sidecars.pair(b_args=Faults(link_rate=RATE).flags() + ["--resume-timeout-s", "30"])
    payload = os.urandom(16 << 20)      # ~2 s on the link: more than a's and b's buffers hold at the kill
    handle = a.client().send("b", "resume-2", payload, priority="high")
    wait_until(lambda: received_bytes(b) > (2 << 20), what="2 MiB at b")
    a.kill9()
    with pytest.raises(KVFlowError) as e:
        handle.wait(30)
    assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    held = received_bytes(b)
    assert held >= 2 << 20                            # b keeps the partial transfer for a resume
    a.restart()
    result = a.client().send("b", "resume-2", payload, priority="high", resume=True).wait(60)
    chunk = len(payload) // result.chunks              # 256 KiB parts (packed ones on a faster link)
    assert result.resumed_chunks * chunk >= held - chunk
    assert sha(b.client().recv("resume-2", timeout_s=30)) == sha(payload)


def test_kvflow_checksum_mismatch_is_retransmitted(sidecars):
    # 1 chunk in 3 corrupted at random: with the default 8 retransmits, one of the 96 chunks fails 9
    # times in a row in about 1 run in 200 (a DATA_LOSS the test did not ask about); 30 makes that
    # (1/3)^31 per chunk
    a, b = sidecars.pair(a_args=Faults(corrupt_every=3).flags() + ["--chunk-size", "64KiB", "--max-chunk-size",
                                                                   "64KiB", "--whole-part-bytes", "0",
                                                                   "--max-retransmits", "30"])
    ca, cb = a.client(), b.client()
    payload = os.urandom(3 << 20)
    for flow in (True, False):
        result = ca.send("b", f"corrupt-{flow}", payload, flow=flow).wait(60)
        assert result.retransmits > 0
        assert sha(cb.recv(f"corrupt-{flow}", timeout_s=30)) == sha(payload)


def test_kvflow_faults_injected_through_the_transport_seam():
    """In one process: sidecar a's transports wrapped by CorruptingTransport (Sidecar's wrap_transport), b
    reading through a RateLimit (its inbound_throttle); no fault flag involved."""
    import asyncio

    from ciuicflow.kvflow import Client
    from ciuicflow.kvflow.sidecar.app import Sidecar
    from ciuicflow.kvflow.sidecar.config import load_config
    from tests.kvflow.sidecars import free_port

    ports = {"a": free_port(), "b": free_port()}
    payload = os.urandom(1 << 20)

    def config(name, other):
        return load_config(["--name", name, "--api", "127.0.0.1:0", "--listen", f"127.0.0.1:{ports[name]}",
                            "--peer", f"{other}=127.0.0.1:{ports[other]}", "--chunk-size", "64KiB",
                            "--max-chunk-size", "64KiB", "--whole-part-bytes", "0", "--drain-s", "0"])

    async def run():
        a = Sidecar(config("a", "b"), **Faults(corrupt_every=3).seams())
        b = Sidecar(config("b", "a"), **Faults(link_rate=20_000_000).seams())
        await b.start()
        await a.start()
        loop = asyncio.get_running_loop()
        try:
            def transfer():
                with Client(a.api_address) as ca, Client(b.api_address) as cb:
                    result = ca.send("b", "seam-1", payload).wait(60)
                    return result, cb.recv("seam-1", timeout_s=30)
            result, got = await loop.run_in_executor(None, transfer)
        finally:
            await a.stop()
            await b.stop()
        return result, got, a.stats()["peers"]["b"]

    result, got, peer = asyncio.run(run())
    assert result.retransmits > 0 and peer["retransmits"] > 0
    assert sha(got) == sha(payload)


def test_kvflow_unrecoverable_corruption_is_data_loss_on_both_sides(sidecars):
    a, b = sidecars.pair(a_args=Faults(corrupt_every=1).flags() + ["--max-retransmits", "3"])
    with pytest.raises(KVFlowError) as e:
        a.client().send("b", "broken-1", os.urandom(100_000)).wait(30)
    assert e.value.code == grpc.StatusCode.DATA_LOSS
    with pytest.raises(KVFlowError) as e:
        b.client().recv("broken-1", timeout_s=10)
    assert e.value.code == grpc.StatusCode.DATA_LOSS


def test_kvflow_packed_chunks_survive_a_spooled_receiver_restart(sidecars, tmp_path):
    """A completed transfer of packed chunks, not yet collected, is restored from the spool after the
    receiver is killed, part by part."""
    a, b = sidecars.pair(b_args=["--spool-dir", str(tmp_path / "spool")])
    layers = [os.urandom(30_000 + 7 * i) for i in range(61)]
    a.client().send("b", "warm", [b"x" * 65536] * 61).wait(30)       # the link's rate is known: packing on
    result = a.client().send("b", "packed-spool", layers).wait(30)
    assert result.chunks < 20                                         # 61 layers of ~30 KB, packed
    b.kill9()
    b.restart()
    assert "restored" in b.log()
    assert b.client().recv("packed-spool", timeout_s=10) == layers


def test_kvflow_fault_flags_belong_to_the_tests_launcher():
    """Production's command line knows no fault flag; the tests' launcher takes them and passes the rest on,
    and a sidecar started with one runs as the launcher."""
    import subprocess
    import sys

    from ciuicflow.kvflow.sidecar.config import load_config
    from ciuicflow.testing.kvflow_faults import LAUNCHER, SIDECAR, sidecar_module
    from tests import REPO

    for flag in (["--link-rate", "1MB"], ["--test-corrupt-every", "3"]):
        with pytest.raises(SystemExit):
            load_config(["--name", "x", *flag])
        assert sidecar_module(["--chunk-size", "64KiB", *flag]) == LAUNCHER
    assert sidecar_module(["--link-rate=1MB"]) == LAUNCHER
    assert sidecar_module(["--chunk-size", "64KiB"]) == SIDECAR
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", LAUNCHER, "--test-corrupt-every", "-1", "--name", "x"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--test-corrupt-every must be >= 0" in done.stderr
    done = subprocess.run([sys.executable, "-m", LAUNCHER, "--link-rate", "1MB", "--no-such-flag"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "ciuicflow-sidecar" in done.stderr and "--no-such-flag" in done.stderr
