"""Flow control on a slow link (an emulated 20 Mbit/s into the receiver), between real sidecar processes:
a high-priority transfer must overtake bulk within a small fraction of a second. With the window floor
and chunk size of a fast link (2 MiB, 256 KiB chunks, whole 1 MiB parts) it waited ~0.85 s behind the bulk
bytes already in flight; the floor now follows the measured bandwidth (CongestionController.floor) and
chunks shrink on a slow path (chunking.chunk_bytes)."""
import os
import threading
import time

import pytest

from ciuicflow.kvflow.core.chunking import chunk_bytes
from ciuicflow.kvflow.core.congestion import CongestionController
from ciuicflow.testing.kvflow_faults import Faults

RATE = 2_500_000           # bytes/s: 20 Mbit/s


@pytest.fixture(scope="module")
def slow_pair(module_sidecars):
    return module_sidecars.pair(b_args=Faults(link_rate=RATE).flags())


def test_chunks_and_window_follow_a_slow_path():
    assert chunk_bytes(0, 256 << 10, 4 << 20) == 256 << 10            # not measured yet: as configured
    assert chunk_bytes(12.5e6, 256 << 10, 4 << 20) == 256 << 10       # 100 Mbit/s: 21 ms each
    assert chunk_bytes(RATE, 256 << 10, 4 << 20) == 64 << 10          # 20 Mbit/s: 26 ms each
    assert chunk_bytes(625e3, 256 << 10, 4 << 20) == 32 << 10         # 5 Mbit/s: the smallest
    assert chunk_bytes(625e3, 16 << 10, 4 << 20) == 16 << 10          # a small --chunk-size stays
    cc = CongestionController(lambda: 0.0, chunk_bytes=256 << 10, min_cwnd_bytes=2 << 20, min_cwnd_s=0.2)
    assert cc.floor == 2 << 20                                        # not measured yet
    cc.btl_bw = RATE
    assert cc.floor == 500_000                                        # 0.2 s of the path
    cc.btl_bw = 100e6
    assert cc.floor == 2 << 20                                        # a fast path: --min-cwnd
    fixed = CongestionController(lambda: 0.0, chunk_bytes=256 << 10, min_cwnd_bytes=2 << 20)
    fixed.btl_bw = RATE
    assert fixed.floor == 2 << 20                                     # an explicit --min-cwnd is kept


def _urgent_after_bulk(a, b, tag: str):
    ca, cb = a.client(flow=True), b.client()
    bulk = os.urandom(6 << 20)                 # 2.5 s on the link
    urgent = os.urandom(200 << 10)             # a short prompt's KV: 0.08 s on the link
    done = {}
    t0 = time.monotonic()
    h_bulk = ca.send("b", f"bulk-{tag}", bulk, priority="low")
    waiter = threading.Thread(target=lambda: (h_bulk.wait(60), done.setdefault("bulk", time.monotonic() - t0)))
    waiter.start()
    time.sleep(1.0)                            # the bandwidth is measured, bulk fills the window
    t_urgent = time.monotonic()
    ca.send("b", f"urgent-{tag}", urgent, priority="high").wait(60)
    latency = time.monotonic() - t_urgent
    waiter.join(60)
    assert cb.recv(f"urgent-{tag}", timeout_s=10) == urgent
    assert cb.recv(f"bulk-{tag}", timeout_s=10) == bulk
    return latency, done["bulk"]


def test_high_priority_overtakes_bulk_on_a_slow_link(slow_pair):
    a, b = slow_pair
    latencies = []
    for i in range(2):
        latency, bulk_s = _urgent_after_bulk(a, b, f"slow{i}")
        latencies.append(latency)
        assert bulk_s < 1.6 * (6 << 20) / RATE, f"bulk took {bulk_s:.2f}s: the link was not kept busy"
    print(f"urgent latency on 20 Mbit/s: {[round(x, 3) for x in latencies]} s")
    # its own bytes take 0.08 s, the window of bulk in front 0.2-0.3 s (0.27-0.44 s measured on a busy
    # 2-core host); with a 2 MiB floor and 256 KiB chunks 0.65-0.86 s
    assert min(latencies) < 0.5, latencies
