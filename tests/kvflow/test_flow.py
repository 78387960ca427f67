"""Flow control between real sidecars over an emulated slow link (testing.kvflow_faults): priority overtakes bulk,
deadlines end with an explicit status, graceful shutdown drains or fails explicitly."""
import os
import threading
import time

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.testing.kvflow_faults import Faults

RATE = 10_000_000          # bytes/s of the emulated link into b


@pytest.fixture(scope="module")
def slow_pair(module_sidecars):
    return module_sidecars.pair(b_args=Faults(link_rate=RATE).flags())


def _bulk_then_urgent(a, b, flow: bool, tag: str):
    ca, cb = a.client(flow=flow), b.client()
    bulk = os.urandom(12 << 20)                      # 1.26 s on the link
    urgent = os.urandom(256 << 10)
    done = {}
    t0 = time.monotonic()
    h_bulk = ca.send("b", f"bulk-{tag}", bulk, priority="low")
    h_bulk_thread = threading.Thread(target=lambda: (h_bulk.wait(60), done.setdefault("bulk", time.monotonic())))
    h_bulk_thread.start()
    time.sleep(0.25)
    t_urgent = time.monotonic()
    ca.send("b", f"urgent-{tag}", urgent, priority="high").wait(60)
    done["urgent"] = time.monotonic()
    h_bulk_thread.join(60)
    assert cb.recv(f"urgent-{tag}", timeout_s=10) == urgent
    assert cb.recv(f"bulk-{tag}", timeout_s=10) == bulk
    return done["urgent"] - t_urgent, done["bulk"] - t0, done["urgent"] < done["bulk"]


def test_kvflow_priority_overtakes_bulk(slow_pair):
    a, b = slow_pair
    flow_latency, flow_bulk, flow_first = _bulk_then_urgent(a, b, True, "flow")
    fifo_latency, fifo_bulk, fifo_first = _bulk_then_urgent(a, b, False, "fifo")
    print(f"urgent latency: flow {flow_latency:.3f}s, fifo {fifo_latency:.3f}s; "
          f"bulk {flow_bulk:.2f}s / {fifo_bulk:.2f}s")
    assert flow_first and not fifo_first
    assert flow_latency < 0.5                # typically ~0.1 s: one window of bulk, then its own chunk
    assert flow_latency < 0.5 * fifo_latency # FIFO waits for the rest of the bulk transfer (~1 s)
    # the bulk transfer still kept the link busy: not much slower than the link allows
    assert flow_bulk < 2.0 * (12 << 20) / RATE
    st = a.client().stats()["peers"]["b"]["cc"]
    assert st["btl_bw_bytes_per_s"] == pytest.approx(RATE, rel=0.5)


def test_kvflow_deadline_exceeded_is_explicit_on_both_sides(slow_pair):
    a, b = slow_pair
    ca, cb = a.client(), b.client()
    with pytest.raises(KVFlowError) as e:
        ca.send("b", "late-1", os.urandom(8 << 20), priority="normal", deadline_s=0.3).wait(30)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(KVFlowError) as e:
        cb.recv("late-1", timeout_s=5)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ca.stats()["memory"]["used"] == 0
    assert cb.stats()["memory"]["used"] == 0
    # the key can be used again afterwards
    ca.send("b", "late-1", b"on time", deadline_s=10).wait(30)
    assert cb.recv("late-1", timeout_s=5) == b"on time"


def test_kvflow_graceful_shutdown_drains_then_fails_explicitly(sidecars):
    a, b = sidecars.pair(a_args=["--drain-s", "1.0"], b_args=Faults(link_rate=RATE).flags())
    ca, cb = a.client(), b.client()
    short = os.urandom(2 << 20)                       # ~0.2 s: finishes during the drain
    h_short = ca.send("b", "drain-short", short, priority="high")
    h_long = ca.send("b", "drain-long", os.urandom(40 << 20), priority="low")    # ~4 s: cannot
    time.sleep(0.1)
    a.proc.send_signal(__import__("signal").SIGTERM)
    assert h_short.wait(30).bytes == len(short)
    with pytest.raises(KVFlowError) as e:
        h_long.wait(30)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert a.proc.wait(30) == 0
    assert cb.recv("drain-short", timeout_s=5) == short
    with pytest.raises(KVFlowError) as e:
        cb.recv("drain-long", timeout_s=5)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "stopped" in a.log()


@pytest.mark.parametrize("flow", [True, False])
def test_kvflow_shutdown_aborts_reach_a_slow_receiver(sidecars, flow):
    # The abort queues behind data already in the stream; at 4 MB/s that data takes well over 0.1 s to
    # drain, and the receiver must still learn that the transfer failed (not wait out the resume timeout).
    a, b = sidecars.pair(a_args=["--drain-s", "0"], b_args=Faults(link_rate=4_000_000).flags())
    ca, cb = a.client(), b.client()
    h = ca.send("b", "cut-short", os.urandom(64 << 20), priority="low", flow=flow)
    time.sleep(0.5)
    a.proc.send_signal(__import__("signal").SIGTERM)
    with pytest.raises(KVFlowError) as e:
        h.wait(30)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert a.proc.wait(30) == 0
    t0 = time.monotonic()
    with pytest.raises(KVFlowError) as e:
        cb.recv("cut-short", timeout_s=10)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
    assert time.monotonic() - t0 < 5
    assert cb.stats()["memory"]["used"] == 0
