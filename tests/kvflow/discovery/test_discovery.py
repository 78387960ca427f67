"""Discovery through a real etcd on loopback (the etcd fixture of conftest.py here starts it): sidecars that register, find
each other, drop the dead and refuse impostors, as real processes on 127.0.0.1 (docs/discovery.md)."""
import asyncio
import json
import signal
import time

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.discovery.etcd import EtcdClient
from tests.kvflow.sidecars import wait_until
from tests.kvflow.discovery.nodes import PREFIX, TTL, _etcd_put, _make, _send_when_found

def _discovered(sc) -> dict:
    return sc.stats()["discovery"]["peers"]


def _logged_at(log: str, text: str) -> float:
    """The wall-clock time of the first log line containing ``text`` (the sidecar's logging format)."""
    import datetime
    for line in log.splitlines():
        if text in line:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise AssertionError(f"{text!r} not in the log")


def test_joining_sidecar_receives_a_transfer_within_2s(sidecars, tmp_path, etcd):
    """A decode sidecar started into a running fleet is found and receives a transfer within 2 s of its
    start, without restarting anything."""
    a = _make(sidecars, tmp_path, etcd, "a", role="prefill")
    sidecars.start_all(a)
    ca = a.client()
    d = _make(sidecars, tmp_path, etcd, "d", role="decode")
    spawned = time.monotonic()
    d.start().wait_ready()
    ready = time.monotonic()
    _send_when_found(ca, "d", "first", b"kv" * 1000, timeout=10)
    accepted = time.monotonic()
    assert d.client().recv("first", timeout_s=10, source="a") == b"kv" * 1000
    print(f"\njoin: spawn->ready {ready - spawned:.2f}s, ready->first accepted transfer {accepted - ready:.2f}s, "
          f"spawn->accepted {accepted - spawned:.2f}s")
    assert accepted - ready <= 2.0, f"first transfer {accepted - ready:.2f}s after the sidecar was ready"
    assert _discovered(a)["d"]["role"] == "decode"


def test_killed_sidecar_is_dropped_within_ttl_and_sends_to_it_fail_fast(sidecars, tmp_path, etcd):
    a, b = _make(sidecars, tmp_path, etcd, "a"), _make(sidecars, tmp_path, etcd, "b")
    sidecars.start_all(a, b)
    ca = a.client()
    _send_when_found(ca, "b", "warm", b"x" * 100, timeout=10)
    wait_until(lambda: "b" in _discovered(a), 5, "b adopted by a")
    b.proc.send_signal(signal.SIGKILL)
    died, died_wall = time.monotonic(), time.time()
    b.proc.wait(10)
    # sent after the death, before the lease ran out: fails when b is dropped, not after --resume-timeout-s
    pending = ca.send("b", "into-the-void", b"y" * 100)
    wait_until(lambda: "b" not in _discovered(a), TTL + 5, "b dropped")
    # when a dropped b, by a's own log (the test's Stats polling adds its own delay on a busy host)
    dropped = _logged_at(a.log(), "peer b removed") - died_wall
    with pytest.raises(KVFlowError) as err:
        pending.wait(5)
    failed = time.monotonic() - died
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "gone" in err.value.details, err.value.details
    t0 = time.monotonic()
    with pytest.raises(KVFlowError) as err:
        ca.send("b", "after", b"z").wait(5)
    refused = time.monotonic() - t0
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "registration ended" in err.value.details
    print(f"\ndeath->dropped {dropped:.2f}s (ttl {TTL}s), death->pending send failed {failed:.2f}s, "
          f"later send refused in {refused * 1000:.0f} ms")
    assert dropped <= TTL + 1.0
    assert failed <= TTL + 1.5
    assert refused < 0.5


def test_entry_whose_name_its_peer_cannot_prove_is_ignored(sidecars, tmp_path, etcd):
    """An impostor registers as 'c' (it does not hold the secret a shares with c); a forged entry names 'd'
    at the impostor's address; a garbage entry; all are ignored and logged, and a keeps sending to b."""
    a, b = _make(sidecars, tmp_path, etcd, "a"), _make(sidecars, tmp_path, etcd, "b")
    impostor = _make(sidecars, tmp_path, etcd, "c", overrides={("a", "c"): "not-the-secret"})
    sidecars.start_all(a, b, impostor)
    _etcd_put(etcd.endpoint, f"{PREFIX}/d", json.dumps(
        {"v": 1, "name": "d", "role": "decode", "addresses": {"peer": impostor.listen}}).encode())
    _etcd_put(etcd.endpoint, f"{PREFIX}/e", b"\xff" * 5000)
    ca = a.client()
    _send_when_found(ca, "b", "to-b", b"ok", timeout=10)
    # e is counted when the watch reaches it, which may come after d shows as ignored
    wait_until(lambda: {"c", "d"} <= set(a.stats()["discovery"]["ignored"])
               and a.stats()["discovery"]["rejected_entries"] >= 1, 10, "c and d ignored, e rejected")
    info = a.stats()["discovery"]
    assert set(info["peers"]) == {"b"}, info
    assert "does not match the secret" in info["ignored"]["c"], info["ignored"]
    assert "answers as 'c'" in info["ignored"]["d"], info["ignored"]
    for dest in ("c", "d"):
        with pytest.raises(KVFlowError) as err:
            ca.send(dest, f"to-{dest}", b"secret kv").wait(5)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
    log = a.log()
    assert "entry 'c' ignored" in log and "entry 'd' ignored" in log
    assert "to-c" not in impostor.stats()["store"]["keys"]


def test_keep_alive_reports_etcd_gone(etcd):
    """etcd killed under a keep-alive stream: the keep-alive raises EtcdError (then the registration
    starts again), whichever point of its cycle it was at, and never dies with another exception."""
    from ciuicflow.kvflow.discovery.etcd import EtcdError

    async def run():
        client = EtcdClient([etcd.endpoint])
        try:
            lease = await client.grant(5)
            task = asyncio.create_task(client.keep_alive(lease, 0.3))
            await asyncio.sleep(0.5)
            etcd.stop(signal.SIGKILL)
            done, _ = await asyncio.wait({task}, timeout=10)
            assert done, "keep-alive still running 10 s after etcd died"
            return task.exception()
        finally:
            await client.close()
    assert isinstance(asyncio.run(run()), EtcdError)


def test_etcd_restart_keeps_peers_transferring(sidecars, tmp_path, etcd):
    """etcd killed and started again (same data): transfers go on meanwhile, and no peer is dropped."""
    ttl = 4         # etcd extends leases by their TTL (and ~1 s) on restart: the keep-alive must be back by then
    a, b = _make(sidecars, tmp_path, etcd, "a", ttl=ttl), _make(sidecars, tmp_path, etcd, "b", ttl=ttl)
    sidecars.start_all(a, b)
    ca, cb = a.client(), b.client()
    _send_when_found(ca, "b", "before", b"0", timeout=10)
    etcd.stop(signal.SIGKILL)
    down = time.monotonic()
    n = 0
    while time.monotonic() - down < ttl + 1:            # longer than a lease: nothing may expire meanwhile
        ca.send("b", f"during-{n}", b"1" * 1000).wait(5)
        cb.send("a", f"back-{n}", b"2" * 1000).wait(5)
        n += 1
        time.sleep(0.2)
    assert _discovered(a).keys() == {"b"} and _discovered(b).keys() == {"a"}
    etcd.start()
    wait_until(lambda: a.stats()["discovery"]["watch_starts"] >= 2 and b.stats()["discovery"]["watch_starts"] >= 2,
               15, "watches open again")
    # long enough for a lease that nobody keeps alive to expire (a keep-alive that died with etcd's stream)
    time.sleep(2 * ttl + 1)
    ca.send("b", "after", b"3").wait(5)
    assert _discovered(a).keys() == {"b"} and _discovered(b).keys() == {"a"}
    for sc in (a, b):
        info = sc.stats()["discovery"]
        assert info["registered"] and info["registrations"] >= 2, info      # put again after the reconnect
    for i in range(n):
        assert cb.recv(f"during-{i}", timeout_s=5, source="a") == b"1" * 1000
    print(f"\n{n} transfers each way while etcd was down")


def test_mutual_tls_peers_prove_names_with_their_certificates(sidecars, tmp_path, etcd):
    """Under mutual TLS the certificate is the proof: a's channel to a discovered peer checks the peer's
    certificate against the registered name. 'c' holds a certificate of the right CA, but for 'x'."""
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    from tests.kvflow.certs import make_ca, make_leaf
    ca = make_ca(tmp_path, "ca")

    def make(name, cert_name):
        cert, key = make_leaf(tmp_path, ca, cert_name, dns_name=cert_name)
        return sidecars.make(name, args=["--discovery", etcd.url(PREFIX), "--discovery-ttl-s", str(TTL),
                                         "--tls-cert", cert, "--tls-key", key, "--tls-ca", str(tmp_path / "ca.pem")])
    a, b, c = make("a", "a"), make("b", "b"), make("c", "x")
    sidecars.start_all(a, b, c)
    _send_when_found(a.client(), "b", "over-tls", b"tls" * 100, timeout=10)
    assert b.client().recv("over-tls", timeout_s=10, source="a") == b"tls" * 100
    wait_until(lambda: "c" in a.stats()["discovery"]["ignored"], 10, "c ignored")
    assert set(_discovered(a)) == {"b"}
    assert "TLS with its peer" in a.stats()["discovery"]["ignored"]["c"]
    with pytest.raises(KVFlowError) as err:
        a.client().send("c", "to-c", b"kv").wait(5)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
