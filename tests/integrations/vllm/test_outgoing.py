"""The prefill side's save path on a slow link, against real sidecar processes (the decode sidecar reads
its peer at an emulated 40 Mbit/s): vLLM's forward pass (``save_kv_layer`` ... ``wait_for_save``) must not
wait for the link, with flow control on, even for a low-priority transfer far larger than the sidecar's
ingest read-ahead plus the client's shared-memory window; and a high-priority request saved in the next
step must reach the decode side long before that bulk transfer, intact."""
import time

import pytest
import torch

from ciuicflow.integrations.vllm.config import Settings
from ciuicflow.integrations.vllm.metadata import CiuicFlowMetadata, SaveSpec
from ciuicflow.integrations.vllm.transfer import tokens_sha
from ciuicflow.integrations.vllm.worker import WorkerSide
from tests.kvflow.sidecars import SidecarFactory
from tests.integrations.vllm.specs import load_spec

NUM_BLOCKS = 256            # DeepSeek MLA blocks [1, 16, 576] fp32: 36 KiB each, 9.4 MB per layer
LAYERS = 3
LINK = "40Mbit"             # 5 MB/s: the 28 MB bulk transfer needs ~5.7 s of link


@pytest.fixture
def slow_pair(tmp_path):
    factory = SidecarFactory(tmp_path)
    p = factory.make("prefill0")
    d = factory.make("decode0", args=["--link-rate", LINK])
    p.peers = {"decode0": d.listen}
    d.peers = {"prefill0": p.listen}
    factory.start_all(p, d)
    yield p, d
    factory.cleanup()


def request(rid, blocks, prio):
    tokens = len(blocks) * 16
    return dict(id=rid, key=f"k-{rid}", tokens=tokens, bs=16, sha=tokens_sha(list(range(tokens))), src=blocks,
                dst=blocks, prio=prio)


def step(w, kv, reqs):
    """One forward pass that saves ``reqs``: seconds spent in the connector's save calls."""
    w.meta = CiuicFlowMetadata(saves=[SaveSpec(r["id"], r["key"], "decode0", r["src"], r["tokens"], r["sha"],
                                               r["prio"], None, True) for r in reqs])
    t0 = time.monotonic()
    for name in w.layer_names:
        w.save_kv_layer(name, kv[name].view(NUM_BLOCKS, 16, 576))
    w.wait_for_save()
    w.meta = None
    return time.monotonic() - t0


def test_save_never_waits_for_the_link_and_high_overtakes_bulk(slow_pair):
    p, d = slow_pair
    g = torch.Generator().manual_seed(5)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, 1, 16, 576, generator=g) for i in range(LAYERS)}
    bulk = request("bulk", list(range(0, 250)), "low")
    high = request("high", [250, 251], "high")
    w = WorkerSide(Settings(sidecar=p.api), NUM_BLOCKS)
    w.register_kv_caches(kv)
    t0 = time.monotonic()
    bulk_save = step(w, kv, [bulk])
    high_save = step(w, kv, [high])
    # Before: the bulk transfer's appends blocked the forward pass until all but ~12 MiB had crossed the
    # link (2.7 s here); the high-priority request's step could not even start meanwhile.
    assert bulk_save < 1.5, f"the forward pass waited {bulk_save:.2f}s for the link (bulk)"
    assert high_save < 1.0, f"the forward pass waited {high_save:.2f}s for the link (high)"
    done = {}
    deadline = time.monotonic() + 60
    while len(done) < 2 and time.monotonic() < deadline:
        sent, _ = w.get_finished({"bulk", "high"} - set(done))
        for rid in sent or ():
            done[rid] = time.monotonic() - t0
        time.sleep(0.01)
    assert set(done) == {"bulk", "high"}, f"sends not finished: {done}"
    assert w.stats == {"sent": 2, "send_failed": 0, "loaded": 0, "load_failed": 0}
    assert done["high"] < 0.5 * done["bulk"], f"high-priority transfer did not overtake bulk: {done}"
    dst = {n: torch.zeros_like(t) for n, t in kv.items()}
    dw = WorkerSide(Settings(sidecar=d.api), NUM_BLOCKS)
    dw.register_kv_caches(dst)
    dw.meta = CiuicFlowMetadata(loads=[load_spec(r, r["dst"]) for r in (high, bulk)])
    dw.start_load_kv()
    finished, deadline = set(), time.monotonic() + 30
    while len(finished) < 2 and time.monotonic() < deadline:
        finished |= dw.get_finished(set())[1] or set()
        time.sleep(0.02)
    assert finished == {"bulk", "high"} and dw.get_block_ids_with_load_errors() == set()
    for name in kv:
        assert torch.equal(dst[name][:252], kv[name][:252]), name
