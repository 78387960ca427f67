"""Real sidecar processes on loopback: transfers intact, streaming receive, bad input, leases, memory cap,
health, reflection, metrics, config file."""
import hashlib
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.core.limits import CHUNK_OVERHEAD, PART_INFO_OVERHEAD
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from tests.kvflow.sidecars import wait_until
from ciuicflow.testing.kvflow_faults import Faults

CHUNK = 64 << 10          # small chunks: many chunks per transfer at small sizes


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def pair(module_sidecars, tmp_path_factory):
    """a <-> b, b configured from a TOML file, with metrics."""
    f = module_sidecars
    a = f.make("a", args=["--chunk-size", str(CHUNK)])
    b = f.make("b")
    metrics_port = f.free_port()
    cfg = tmp_path_factory.mktemp("cfg") / "b.toml"
    cfg.write_text(f'chunk_size = "{CHUNK}"\nmetrics_port = {metrics_port}\nlease_s = 30\n'
                   f'[peers]\na = "{a.listen}"\n')
    b.args = ["--config", str(cfg)]
    a.peers = {"b": b.listen}
    f.start_all(a, b)
    b.metrics_port = metrics_port
    return a, b


SIZES = [0, 1, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 5_000_000]


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "fifo"])
def test_kvflow_many_sizes_arrive_intact(pair, flow):
    a, b = pair
    ca, cb = a.client(flow=flow), b.client()
    payloads = {f"size-{flow}-{n}": os.urandom(n) for n in SIZES}
    handles = {k: ca.send("b", k, v, priority=["high", "normal", "low"][i % 3])
               for i, (k, v) in enumerate(payloads.items())}
    for k, h in handles.items():
        r = h.wait(60)
        assert r.bytes == len(payloads[k]) and r.flow == flow
    for k, v in payloads.items():
        got = cb.recv(k, timeout_s=30)
        assert isinstance(got, bytes)
        assert sha(got) == sha(v), k
    assert cb.stats()["memory"]["used"] == 0
    # the sender keeps each transfer until the receiver's consumer has it (Delivery guarantees)
    wait_until(lambda: ca.stats()["memory"]["used"] == 0, what="sender's memory released")


def test_kvflow_tensors_arrive_with_dtype_and_shape(pair):
    torch = pytest.importorskip("torch")
    a, b = pair
    ca, cb = a.client(), b.client()
    layers = [torch.randn(1, 1, 300, 512), torch.randn(1, 1, 300, 64).to(torch.bfloat16),
              torch.arange(100_000, dtype=torch.int64).reshape(1000, 100), torch.zeros(0, 4),
              torch.randn(4, 4, dtype=torch.float16).t(), torch.tensor(7, dtype=torch.int32)]
    ca.send("b", "tensors-1", layers, priority="high").wait(30)
    got = cb.recv("tensors-1", timeout_s=30)
    assert len(got) == len(layers)
    for x, y in zip(got, layers):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    # mixed list: tensors and raw bytes
    ca.send("b", "mixed-1", [b"hdr", torch.ones(3)]).wait(30)
    got = cb.recv("mixed-1", timeout_s=30)
    assert got[0] == b"hdr" and torch.equal(got[1], torch.ones(3))


def test_kvflow_streaming_receive_gets_first_layers_early(pair):
    torch = pytest.importorskip("torch")
    a, b = pair
    ca, cb = a.client(), b.client()
    layers = [torch.full((64, 576), float(i)) for i in range(6)]
    arrivals = {}
    received = []

    def consume():
        for part in cb.recv_stream("stream-1", timeout_s=30):
            arrivals[part.index] = time.monotonic()
            received.append(part)

    consumer = threading.Thread(target=consume)
    consumer.start()
    appended = {}
    with ca.open("b", "stream-1", priority="high") as stream:
        for i, layer in enumerate(layers):
            stream.append(layer, name=f"layer.{i}")
            appended[i] = time.monotonic()
            time.sleep(0.3)                      # prefill of the next layer
    stream.handle.wait(30)
    consumer.join(30)
    assert [p.index for p in received] == list(range(6))
    assert [p.name for p in received] == [f"layer.{i}" for i in range(6)]
    for p, layer in zip(received, layers):
        assert torch.equal(p.value, layer)
    # the first layer was usable long before the last one was even produced
    assert arrivals[0] < appended[5] - 0.5
    assert stream.handle.wait().chunks >= 6


def test_kvflow_bad_input_gets_clear_errors(pair):
    a, b = pair
    ca, cb = a.client(), b.client()
    with pytest.raises(KVFlowError) as e:
        ca.send("nobody", "k", b"x").wait(10)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "unknown peer" in e.value.details
    with pytest.raises(KVFlowError) as e:
        ca.send("b", "", b"x").wait(10)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        ca.send("b", "k", b"x", priority="urgent")

    # duplicate key: completed and not yet collected on b
    ca.send("b", "dup-1", b"first").wait(10)
    with pytest.raises(KVFlowError) as e:
        ca.send("b", "dup-1", b"second", resume=False).wait(10)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS and "duplicate key" in e.value.details
    assert cb.recv("dup-1", timeout_s=5) == b"first"

    # hand-made streams through the raw stub
    channel = grpc.insecure_channel(a.api)
    send = channel.stream_unary("/ciuicflow.kvflow.v1.KVFlow/Send")   # raw bytes in and out

    def call(messages, metadata=a.api_metadata()):
        with pytest.raises(grpc.RpcError) as err:
            send(iter(messages), metadata=metadata, timeout=10)
        return err.value.code(), err.value.details()

    header = pb.SendRequest(header=pb.SendHeader(dest="b", key="raw-1", priority=pb.NORMAL))
    info0 = pb.PartInfo(index=0, nbytes=10)
    code, details = call([b"\xff\xff\xff\xff garbage"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in details
    code, details = call([pb.SendRequest(end=pb.SendEnd()).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in details
    code, details = call([header.SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=1, offset=0, data=b"x",
                                                          info=pb.PartInfo(index=1, nbytes=1))).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in details
    code, details = call([header.SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=0, offset=0, data=b"12345", info=info0)).SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=0, offset=7, data=b"67890")).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of order" in details
    code, details = call([header.SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=0, offset=0, data=b"x" * 11, info=info0)).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    bad_tensor = pb.PartInfo(index=0, nbytes=10, is_tensor=True, dtype="float32", shape=[3])
    code, details = call([header.SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=0, offset=0, data=b"x" * 10, info=bad_tensor)).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "shape" in details
    bad_dtype = pb.PartInfo(index=0, nbytes=4, is_tensor=True, dtype="float33", shape=[1])
    code, details = call([header.SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=0, offset=0, data=b"x" * 4, info=bad_dtype)).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in details
    code, details = call([header.SerializeToString(), pb.SendRequest(end=pb.SendEnd(num_parts=2)).SerializeToString()])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "parts" in details
    # oversized message (over --max-message-bytes, 8 MiB)
    code, details = call([header.SerializeToString(),
                          pb.SendRequest(data=pb.SendData(part=0, offset=0, data=b"x" * (9 << 20),
                                                          info=pb.PartInfo(index=0, nbytes=9 << 20))).SerializeToString()])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # garbage on the peer port
    peer_ch = grpc.insecure_channel(b.listen)
    link = peer_ch.stream_stream("/ciuicflow.kvflow.v1.KVFlowPeer/Link")
    with pytest.raises(grpc.RpcError) as err:
        list(link(iter([b"\xff\xff\xff\xff"]), metadata=(("x-ciuic-peer", "a"),), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(link(iter([]), metadata=(("x-ciuic-peer", "mallory"),), timeout=10))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # a Recv with a bad key, and one that times out
    with pytest.raises(KVFlowError) as e:
        cb.recv("", timeout_s=1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(KVFlowError) as e:
        cb.recv("never-sent", timeout_s=0.3)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    channel.close()
    peer_ch.close()

    # still healthy, and still moving data
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for addr in (a.api, b.api, b.listen):
        with grpc.insecure_channel(addr) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    ca.send("b", "after-bad-input", b"ok").wait(10)
    assert cb.recv("after-bad-input", timeout_s=5) == b"ok"


def test_kvflow_reflection_and_metrics(pair):
    a, b = pair
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(b.api) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"ciuicflow.kvflow.v1.KVFlow", "grpc.health.v1.Health"} <= names
    a.client().send("b", "metrics-1", os.urandom(300_000), priority="high").wait(10)
    assert len(b.client().recv("metrics-1", timeout_s=5)) == 300_000
    text = urllib.request.urlopen(f"http://127.0.0.1:{b.metrics_port}/metrics", timeout=5).read().decode()
    assert 'ciuicflow_kvflow_bytes_total{direction="recv",peer="a",priority="high"}' in text
    for name in ("ciuicflow_kvflow_transfer_seconds_bucket", "ciuicflow_kvflow_queue_depth",
                 "ciuicflow_kvflow_rejected_requests_total", "ciuicflow_kvflow_leases_expired_total"):
        assert name in text
    st = a.client().stats()["peers"]["b"]
    assert st["connected"] and st["cc"]["min_rtt_s"] > 0 and st["cc"]["btl_bw_bytes_per_s"] > 0


def test_kvflow_leases_expire(sidecars):
    a, b = sidecars.pair(b_args=["--lease-s", "0.6"])
    ca, cb = a.client(), b.client()
    ca.send("b", "lease-1", os.urandom(200_000)).wait(10)
    ca.send("b", "lease-2", os.urandom(1000), lease_s=20).wait(10)     # a longer lease of its own
    assert cb.stats()["memory"]["used"] > 200_000
    time.sleep(1.5)
    with pytest.raises(KVFlowError) as e:
        cb.recv("lease-1", timeout_s=1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "expired" in e.value.details
    st = cb.stats()
    held = 1000 + CHUNK_OVERHEAD + PART_INFO_OVERHEAD                    # bytes + what its description costs
    assert st["store"]["expired"] == 1 and held < st["memory"]["used"] < held + 64
    assert len(cb.recv("lease-2", timeout_s=5)) == 1000
    assert cb.stats()["memory"]["used"] == 0


def test_kvflow_memory_cap_holds_under_overload(sidecars):
    cap_b_peer, cap_b_total = 2 << 20, 3 << 20
    a, b = sidecars.pair(
        a_args=["--max-peer-bytes", str(4 << 20), "--max-total-bytes", str(5 << 20), "--admission-timeout-s", "1",
                "--stall-timeout-s", "2", "--chunk-size", str(CHUNK)],
        b_args=["--max-peer-bytes", str(cap_b_peer), "--max-total-bytes", str(cap_b_total)])
    ca, cb = a.client(), b.client()
    # larger than the cap: refused at once
    with pytest.raises(KVFlowError) as e:
        ca.send("b", "too-big", os.urandom(5 << 20)).wait(10)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # overload: 16 senders of 512 KiB against 2 MiB at b (nobody collects) and 4 MiB at a
    payloads = {f"load-{i}": os.urandom(512 << 10) for i in range(16)}
    with ThreadPoolExecutor(16) as pool:
        handles = {k: ca.send("b", k, v) for k, v in payloads.items()}

        def outcome(h):
            try:
                h.wait(60)
                return "OK"
            except KVFlowError as exc:
                return exc.code.name
        results = dict(zip(handles, pool.map(outcome, handles.values())))
    ok = [k for k, r in results.items() if r == "OK"]
    assert set(results.values()) <= {"OK", "RESOURCE_EXHAUSTED"}, results
    assert 0 < len(ok) <= 4 and "RESOURCE_EXHAUSTED" in results.values()
    sb, sa = cb.stats()["memory"], ca.stats()["memory"]
    assert sb["peak"] <= cap_b_total and sb["peak_per_peer"]["a"] <= cap_b_peer
    assert sa["peak"] <= 5 << 20 and sa["peak_per_peer"]["b"] <= 4 << 20
    assert sa["used"] <= len(ok) * ((512 << 10) + (4 << 10))    # kept for the receiver until collected
    # what was accepted is intact; once collected, there is room again
    for k in ok:
        assert sha(cb.recv(k, timeout_s=10)) == sha(payloads[k])
    assert cb.stats()["memory"]["used"] == 0
    wait_until(lambda: ca.stats()["memory"]["used"] == 0, what="sender's memory released")
    ca.send("b", "after-overload", os.urandom(1 << 20)).wait(30)
    assert len(cb.recv("after-overload", timeout_s=10)) == 1 << 20


def test_kvflow_backpressure_slows_open_stream(sidecars, tmp_path):
    """An open transfer appends faster than the link drains: append blocks instead of buffering without
    bound, and the sidecar's buffered bytes stay under its cap. (The receiver spools to disk, so the
    sender frees acknowledged chunks and a transfer may be larger than the sender's cap.)"""
    a, b = sidecars.pair(a_args=["--max-peer-bytes", str(1 << 20), "--max-total-bytes", str(1 << 20),
                                 "--chunk-size", str(CHUNK), "--admission-timeout-s", "20"],
                         b_args=Faults(link_rate=8_000_000).flags() + ["--spool-dir", str(tmp_path / "spool")])
    # The client writes at most its shared-memory window ahead of the sidecar (8 MiB by default, most of
    # this 12 MiB transfer); a 4 MiB window leaves the sidecar's back-pressure something to hold back.
    ca, cb = a.client(shm_window_bytes=4 << 20), b.client()
    t0 = time.monotonic()
    with ca.open("b", "bp-1", payload_kind="bytes") as stream:
        for _ in range(96):
            stream.append(os.urandom(128 << 10))       # 12 MiB in all, over an 8 MB/s link
    appended = time.monotonic() - t0
    stream.handle.wait(30)
    total = time.monotonic() - t0
    print(f"appended in {appended:.2f}s, delivered in {total:.2f}s")
    # the sender could not run ahead by more than the sidecar's 1 MiB plus its window: without
    # backpressure the appends take < 0.1 s; here they wait for most of the 1.6 s the link needs
    assert appended > 0.4
    assert len(cb.recv("bp-1", timeout_s=10)) == 12 << 20
    assert ca.stats()["memory"]["peak"] <= 1 << 20
