"""The vLLM proxy's servers from the registry (a real etcd on loopback, its JSON gateway), and the choice of a
decode server by the load its sidecar reports."""
import json
import time
import urllib.request

from ciuicflow.integrations.vllm.proxy_registry import RegistryView
from ciuicflow.integrations.vllm.proxy_router import Router
from tests.kvflow.sidecars import wait_until
from tests.kvflow.discovery.nodes import PREFIX, _etcd_put, _make, _send_when_found


def _entry(name, role, port, transfers=0, queued=0, link=0):
    return json.dumps({"v": 1, "name": name, "role": role, "addresses": {
        "peer": f"127.0.0.1:{port}", "server": f"http://127.0.0.1:{port + 1}"},
        "load": {"queued_bytes": queued, "transfers": transfers, "link_bps": link}}).encode()


def test_proxy_takes_servers_registered_by_sidecars(sidecars, tmp_path, etcd):
    """Sidecars started with --server-url and --role appear in the proxy's view with their load; one that
    stops leaves it."""
    view = RegistryView(etcd.endpoint, PREFIX).start()
    p = _make(sidecars, tmp_path, etcd, "a", role="prefill", extra=["--server-url", "http://127.0.0.1:8100"])
    metrics_port = sidecars.free_port()
    d = _make(sidecars, tmp_path, etcd, "d", role="decode", extra=["--server-url", "http://127.0.0.1:8200",
                                                                   "--metrics-port", str(metrics_port)])
    sidecars.start_all(p, d)
    wait_until(lambda: [len(x) for x in view.servers()] == [1, 1], 5, "both servers seen")
    prefills, decodes = view.servers()
    assert (prefills[0].name, prefills[0].server) == ("a", "http://127.0.0.1:8100")
    assert (decodes[0].name, decodes[0].server, decodes[0].role) == ("d", "http://127.0.0.1:8200", "decode")
    assert d.stats()["load"].keys() == {"queued_bytes", "transfers", "link_bps"}
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for field in ("transfers", "queued_bytes", "link_bps"):
        assert f"ciuicflow_kvflow_load_{field} " in metrics, field
    router = Router([], [], registry=view)
    assert router.pick() == ("http://127.0.0.1:8100", "http://127.0.0.1:8200", "d")
    # a transfer held at d, not collected: its bytes are d's load, in Stats and (sampled) in the registry
    _send_when_found(p.client(), "d", "held", b"k" * (1 << 20), timeout=10)
    assert d.stats()["load"]["queued_bytes"] >= 1 << 20
    wait_until(lambda: view.servers()[1][0].load.queued_bytes >= 1 << 20, 5, "d's load in the registry")
    d.terminate()           # a graceful stop revokes the lease: gone at once
    wait_until(lambda: not view.servers()[1], 3, "d gone from the view")
    view.stop()


def test_decode_chosen_by_reported_load(etcd):
    """The decode server whose sidecar reports fewer transfers (then less queued time) is chosen; the
    proxy's own requests in flight count at once; round robin ignores load."""
    _etcd_put(etcd.endpoint, f"{PREFIX}/p", _entry("p", "prefill", 9000))
    _etcd_put(etcd.endpoint, f"{PREFIX}/d1", _entry("d1", "decode", 9010, transfers=4))
    _etcd_put(etcd.endpoint, f"{PREFIX}/d2", _entry("d2", "decode", 9020, transfers=0, queued=8 << 20, link=1 << 30))
    _etcd_put(etcd.endpoint, f"{PREFIX}/d3", _entry("d3", "decode", 9030, transfers=0, queued=64 << 20, link=1 << 30))
    view = RegistryView(etcd.endpoint, PREFIX).start()
    wait_until(lambda: len(view.servers()[1]) == 3, 5, "three decode servers seen")
    router = Router([], [], registry=view, routing="load")
    picks = [router.pick()[2] for _ in range(6)]          # none finished: the proxy's count grows
    assert picks[0] == "d2", picks                       # fewest transfers, least queued time
    assert picks.count("d1") <= 1, picks                 # the busiest is chosen last
    for peer in picks:
        router.done(peer)
    # the load changes: d2 now the busiest
    _etcd_put(etcd.endpoint, f"{PREFIX}/d2", _entry("d2", "decode", 9020, transfers=9))
    wait_until(lambda: {e.name: e.load.transfers for e in view.servers()[1]}["d2"] == 9, 5, "d2's new load")
    assert router.pick()[2] == "d3"
    rr = Router([], [], registry=view, routing="round-robin")
    assert sorted(rr.pick()[2] for _ in range(3)) == ["d1", "d2", "d3"]
    # a hostile entry is ignored, the others stay
    _etcd_put(etcd.endpoint, f"{PREFIX}/d4", b'{"v": 1, "name": "d4", "role": "decode", "load": {"transfers": -1}}')
    time.sleep(0.5)
    assert {e.name for e in view.servers()[1]} == {"d1", "d2", "d3"}
    view.stop()


def test_own_requests_in_a_load_sample_count_once(etcd):
    """A load sample counts the proxy's own requests then in flight; once they finished, the server is idle,
    however busy the (older) sample says it is. Before: a sample's transfers were added to the proxy's own
    count, so a server that had just served two of this proxy's requests looked busier for up to a sampling
    period than one busy with a transfer the proxy did not send, and was passed over for it."""
    _etcd_put(etcd.endpoint, f"{PREFIX}/p", _entry("p", "prefill", 9000))
    _etcd_put(etcd.endpoint, f"{PREFIX}/d1", _entry("d1", "decode", 9010))
    _etcd_put(etcd.endpoint, f"{PREFIX}/d2", _entry("d2", "decode", 9020))
    view = RegistryView(etcd.endpoint, PREFIX).start()
    wait_until(lambda: len(view.servers()[1]) == 2, 5, "two decode servers seen")
    router = Router([], [], registry=view, routing="load")
    picks = [router.pick()[2] for _ in range(4)]
    assert sorted(picks) == ["d1", "d1", "d2", "d2"], picks      # equal servers share the requests
    router.done("d2")
    router.done("d2")
    # the samples arrive while two of this proxy's requests run at d1 (their transfers in d1's count);
    # d2 has one transfer this proxy did not send (another proxy's request, a KV migration)
    _etcd_put(etcd.endpoint, f"{PREFIX}/d1", _entry("d1", "decode", 9010, transfers=2))
    _etcd_put(etcd.endpoint, f"{PREFIX}/d2", _entry("d2", "decode", 9020, transfers=1))
    wait_until(lambda: {e.name: e.load.transfers for e in view.servers()[1]} == {"d1": 2, "d2": 1}, 5,
               "the samples in the view")
    router.done("d1")
    router.done("d1")
    # d1 is idle now, d2 is not: the next request goes to d1 (before: d1 scored 2, d2 1)
    assert router.pick()[2] == "d1"
    # while it runs, d1 has one request (counted once, by the proxy), d2 one transfer: a tie, not d1 at 3
    from ciuicflow.integrations.vllm.proxy_registry import decode_score
    entries = {e.name: e for e in view.servers()[1]}
    assert decode_score(entries["d1"], 1, 2)[0] == decode_score(entries["d2"], 0, 0)[0] == 1
    # a request in flight when d2's next sample arrives is in that sample: still counted once
    assert router.pick()[2] in ("d1", "d2")
    view.stop()
