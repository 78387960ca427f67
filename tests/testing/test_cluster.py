"""The simulated cluster: real namespaces, a shaped link, torchrun per node, real gloo traffic, clean teardown.

Run as a script under torchrun, this file is also the worker: it all-reduces a tensor and prints what it saw.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from tests import REPO

ROOT = str(REPO)
from ciuicflow.testing import cluster as cl

NUMEL = 1 << 21  # 8 MiB of float32
RATE_BPS = 200e6


def _worker():
    import socket

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((NUMEL,), float(rank + 1))
    dist.barrier()
    before = cl.read_node_link_bytes()  # between barriers: no rank of this node is sending yet
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(x)
    seconds = time.perf_counter() - start
    dist.barrier()  # both ranks of this node are done sending
    after = cl.read_node_link_bytes()
    expected = world * (world + 1) / 2
    # one write() per line: two ranks share the node's output pipe, and print() may write in pieces
    sys.stdout.write("RESULT " + json.dumps({
        "rank": rank, "host": socket.gethostname(), "group_rank": os.environ.get("GROUP_RANK"),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "correct": bool((x == expected).all()),
        "seconds": seconds, "tx": None if before is None else after[0] - before[0]}) + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


def _results(run):
    return [json.loads(line[7:]) for out in run.outputs for line in out.splitlines() if line.startswith("RESULT ")]


def _our_namespaces(tag):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]


need_netns = pytest.mark.skipif(not cl.netns_available()[0],
                                reason=f"network namespaces unavailable: {cl.netns_available()[1]}")


def test_parse_rate():
    assert cl.parse_rate("1gbit") == 1e9
    assert cl.parse_rate("200Mbit/s") == 200e6
    assert cl.parse_rate(5e8) == 5e8
    for bad in ("fast", "-1gbit", "0", "1 parsec"):
        with pytest.raises(ValueError):
            cl.parse_rate(bad)


@need_netns
@pytest.mark.timeout(240)
def test_two_nodes_all_reduce_crosses_the_shaped_link_and_tears_down():
    with cl.SimCluster(nodes=2, ranks_per_node=2, rate=RATE_BPS, require_netns=True) as cluster:
        tag = cluster.tag
        assert cluster.shaped and cluster.netns
        assert len(_our_namespaces(tag)) == 3  # two nodes and the switch
        run = cluster.torchrun(["-m", "tests.testing.test_cluster"], timeout=200)
    assert run.ok, "\n".join(run.outputs)
    results = _results(run)
    assert len(results) == 4 and all(r["correct"] for r in results)
    assert {r["gloo_ifname"] for r in results} == {cl.NODE_IFACE}
    # one torchrun per node: its ranks share a node (host name, GROUP_RANK); the nodes differ
    by_node = {}
    for r in results:
        by_node.setdefault(r["group_rank"], set()).add(r["host"])
    assert sorted(by_node) == ["0", "1"] and all(len(h) == 1 for h in by_node.values())
    assert by_node["0"] != by_node["1"]

    # a ring all-reduce over 4 ranks in node order: each node sends 2 (p-1)/p of the tensor across
    ring_bytes = 2 * 3 / 4 * NUMEL * 4
    leaders = [r for r in results if r["tx"] is not None]
    assert len(leaders) == 4
    for r in leaders:
        assert ring_bytes <= r["tx"] < 1.1 * ring_bytes, r
    # the host's view of the whole launch includes rendezvous and barriers, but not much more
    assert 2 * ring_bytes <= run.inter_node_bytes < 2 * ring_bytes + 4e6
    # the link is really shaped: the all-reduce cannot beat the rate
    slowest = max(r["seconds"] for r in results)
    assert slowest >= 0.9 * ring_bytes * 8 / RATE_BPS, slowest

    assert _our_namespaces(tag) == []
    assert not any(name.startswith(tag) for name in os.listdir(cl.NETNS_ETC)) if os.path.isdir(cl.NETNS_ETC) \
        else True


@need_netns
def test_teardown_on_exception_and_stale_cleanup():
    with pytest.raises(KeyboardInterrupt):
        with cl.SimCluster(nodes=2, ranks_per_node=1, rate="1gbit") as cluster:
            tag = cluster.tag
            proc = cluster.popen(0, ["sleep", "60"])
            raise KeyboardInterrupt  # as Ctrl-C would
    assert _our_namespaces(tag) == []
    assert proc.poll() is not None  # the process in the node was stopped too

    # a namespace of a run whose process is gone is removed by the next cluster (or cleanup_stale)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{cl.NETNS_PREFIX}-{dead.pid}-abcdef-n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in cl.cleanup_stale()
        assert _our_namespaces(stale) == []
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


@pytest.mark.timeout(240)
def test_loopback_fallback_says_so(monkeypatch):
    # SimCluster looks the probe up in its own module (cluster_netns's name is imported there)
    monkeypatch.setattr(cl, "netns_available", lambda: (False, "pretend: not root"))
    messages = []
    with cl.SimCluster(nodes=2, ranks_per_node=1, rate="1gbit", log=messages.append) as cluster:
        assert not cluster.shaped and not cluster.netns
        assert "NOT SHAPED" in cluster.describe() and "NOT SHAPED" in messages[0]
        assert cluster.link_bytes() is None
        run = cluster.torchrun(["-m", "tests.testing.test_cluster"], timeout=200)
    assert run.ok, "\n".join(run.outputs)
    assert run.inter_node_bytes is None and not run.shaped
    results = _results(run)
    assert len(results) == 2 and all(r["correct"] and r["tx"] is None for r in results)
    with pytest.raises(RuntimeError):
        with cl.SimCluster(nodes=2, ranks_per_node=1, require_netns=True):
            pass


_SLOW_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 47001)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); got, first = 0, None
while got < int(sys.argv[1]):
    b = c.recv(65536)
    if not b:
        break
    first = first or time.monotonic()
    got += len(b)
print("RESULT", got, time.monotonic() - first, flush=True)
"""
_SLOW_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 47001)); time.sleep(1.0)   # an idle link: a full bucket
c.sendall(b"x" * int(sys.argv[2])); time.sleep(0.5)
"""


@need_netns
def test_a_slow_link_lets_no_burst_through_after_a_pause():
    """5 Mbit/s: 96 KB sent after a pause take ~0.13 s to arrive (a bucket of 16 KB of MTU packets), not
    a few ms (a 128 KiB bucket: a policer, whose bursts a delivery-rate sender took for an 8 MB/s path)."""
    nbytes = 96_000
    with cl.SimCluster(nodes=2, ranks_per_node=1, rate="5mbit", require_netns=True) as cluster:
        server = cluster.popen(1, [sys.executable, "-c", _SLOW_SERVER, str(nbytes)], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().startswith("listening")
        client = cluster.popen(0, [sys.executable, "-c", _SLOW_CLIENT, cluster.node_addr(1), str(nbytes)])
        out, _ = server.communicate(timeout=30)
        client.wait(30)
    got, seconds = out.split("RESULT")[1].split()
    assert int(got) == nbytes
    assert float(seconds) >= 0.6 * nbytes * 8 / 5e6, f"{nbytes} bytes in {float(seconds):.3f}s on 5 Mbit/s"


if __name__ == "__main__":
    _worker()
