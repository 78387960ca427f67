"""The connector's scheduler side with stand-ins for vLLM's Request, KVCacheBlocks and SchedulerOutput (the
attributes the connector reads, as in vllm 0.32.0): what to send when, what to load into which blocks,
when blocks may be freed, and how priority, deadline and the flow switch are carried. No vLLM needed."""
from types import SimpleNamespace as NS

import pytest

from ciuicflow.integrations.vllm import config as C
from ciuicflow.integrations.vllm.scheduler import SchedulerSide
from ciuicflow.integrations.vllm.transfer import tokens_sha

BS = 16


def request(rid, n, params=None, priority=0):
    return NS(request_id=rid, prompt_token_ids=list(range(n)), kv_transfer_params=params, priority=priority)


def blocks(ids):
    return NS(get_block_ids=lambda: (list(ids),))


def output(new=(), cached=(), scheduled=None):
    """new: (req_id, block_ids, num_computed); cached: (req_id, new_block_ids or None, num_computed)."""
    return NS(scheduled_new_reqs=[NS(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
                                       new_block_ids=[(list(b),) if b is not None else None for _, b, _ in cached],
                                       num_computed_tokens=[c for _, _, c in cached]),
              num_scheduled_tokens=scheduled or {})


def producer(**extra):
    return SchedulerSide(C.Settings(sidecar="127.0.0.1:1", peer="decode0", name="prefill0", **extra), BS, True, False)


def consumer(**extra):
    return SchedulerSide(C.Settings(sidecar="127.0.0.1:1", **extra), BS, False, True)


def test_prefill_sends_in_the_step_that_completes_the_prompt_and_holds_blocks():
    s = producer()
    r = request("r1", 40, {C.P_DECODE: True, C.P_KEY: "k1", C.P_PRIORITY: "high", C.P_DEADLINE: 2.5,
                           C.P_FLOW: "disabled"})
    s.on_new_request(r)
    plain = request("r2", 40)                    # no do_remote_decode: never sent
    s.on_new_request(plain)
    # chunked prefill: 32 of 40 tokens this step (2 blocks), the rest next step (1 new block)
    m1 = s.build_connector_meta(output(new=[("r1", [7, 3], 0), ("r2", [9, 10], 0)], scheduled={"r1": 32, "r2": 32}))
    assert m1.saves == []
    m2 = s.build_connector_meta(output(cached=[("r1", [5], 32)], scheduled={"r1": 8}))
    (spec,) = m2.saves
    assert (spec.key, spec.dest, spec.block_ids, spec.num_tokens) == ("k1", "decode0", [7, 3, 5], 40)
    assert (spec.priority, spec.deadline_s, spec.flow) == ("high", 2.5, False)
    assert spec.tokens_sha == tokens_sha(range(40))
    assert s.build_connector_meta(output(cached=[("r1", None, 40)], scheduled={"r1": 1})).saves == []  # once
    delay, params = s.request_finished(r, [7, 3, 5])
    assert delay is True and s.has_pending_push_work()
    assert params[C.P_PREFILL] is True and params[C.P_KEY] == "k1" and params[C.P_TOKENS] == 40
    assert params[C.P_SOURCE] == "prefill0"
    assert s.request_finished(plain, [9, 10]) == (False, None)
    s.update_connector_output(NS(finished_sending={"r1"}, finished_recving=None))
    assert not s.has_pending_push_work()


@pytest.mark.parametrize("vllm_priority,expected", [(-5, "high"), (0, "normal"), (3, "low")])
def test_priority_from_vllm_request_priority(vllm_priority, expected):
    s = producer()
    r = request("r", 20, {C.P_DECODE: True}, priority=vllm_priority)
    s.on_new_request(r)
    (spec,) = s.build_connector_meta(output(new=[("r", [1, 2], 0)], scheduled={"r": 20})).saves
    assert spec.priority == expected and spec.key == "r" and spec.flow is True and spec.deadline_s is None


def test_request_aborted_before_its_send_is_freed_at_once():
    s = producer()
    r = request("r", 40, {C.P_DECODE: True, C.P_KEY: "k"})
    s.on_new_request(r)
    s.build_connector_meta(output(new=[("r", [1, 2], 0)], scheduled={"r": 32}))
    assert s.request_finished(r, [1, 2]) == (False, None)
    assert s.build_connector_meta(output(cached=[("r", [3], 32)], scheduled={"r": 8})).saves == []


@pytest.mark.parametrize("n", [5, 16, 17, 40])
def test_decode_async_load_plan(n):
    s = consumer()
    r = request("d", n, {C.P_PREFILL: True, C.P_KEY: "k", C.P_TOKENS: n})
    assert s.get_num_new_matched_tokens(r, 0) == (n, True)
    assert s.get_num_new_matched_tokens(r, 0) == (n, True)        # side-effect free
    nb = -(-n // BS)
    s.update_state_after_alloc(r, blocks(range(100, 100 + nb)), n)
    (spec,) = s.build_connector_meta(output()).loads
    assert spec.block_ids == list(range(100, 100 + nb)) and spec.first_block == 0 and spec.sent_blocks == nb
    assert spec.key == "k" and not spec.sync and spec.tokens_sha == tokens_sha(range(n))
    # loaded once: a retry after a failed load recomputes
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, blocks(range(100, 100 + nb)), 0)   # the second call after the load
    assert s.build_connector_meta(output()).loads == []


def test_decode_local_prefix_blocks_are_not_overwritten():
    s = consumer()
    r = request("d", 40, {C.P_PREFILL: True, C.P_KEY: "k"})
    assert s.get_num_new_matched_tokens(r, 16) == (24, True)
    s.update_state_after_alloc(r, blocks([4, 5, 6]), 24)
    (spec,) = s.build_connector_meta(output()).loads
    assert spec.first_block == 1 and spec.block_ids == [4, 5, 6]


def test_decode_layerwise_loads_whole_blocks_and_leaves_a_token():
    s = consumer(load_mode="layerwise")
    r = request("d", 33, {C.P_PREFILL: True, C.P_KEY: "k"})
    assert s.get_num_new_matched_tokens(r, 0) == (32, False)
    assert s.get_num_new_matched_tokens(request("e", 16, {C.P_PREFILL: True, C.P_KEY: "k"}), 0) == (0, False)
    s.update_state_after_alloc(r, blocks([8, 9, 10]), 32)
    (spec,) = s.build_connector_meta(output()).loads
    assert spec.sync and spec.block_ids == [8, 9] and spec.sent_blocks == 3
    assert s.request_finished(r, [8, 9, 10]) == (False, None)   # a layerwise load ends inside its step


def test_decode_mismatched_prompt_is_computed_locally():
    s = consumer()
    r = request("d", 30, {C.P_PREFILL: True, C.P_KEY: "k", C.P_TOKENS: 31, C.P_SOURCE: "prefill0"})
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, blocks([1, 2]), 0)
    meta = s.build_connector_meta(output())
    assert meta.loads == [] and meta.drains == [("k", "prefill0")], "the unused transfer is collected"
    s.update_state_after_alloc(r, blocks([1, 2]), 0)
    assert s.build_connector_meta(output()).drains == []
    assert s.get_num_new_matched_tokens(request("x", 30, {C.P_PREFILL: True}), 0) == (0, False)   # no key


def test_decode_abort_while_loading_keeps_blocks_until_reported():
    s = consumer()
    r = request("d", 30, {C.P_PREFILL: True, C.P_KEY: "k"})
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, blocks([1, 2]), 30)
    s.build_connector_meta(output())
    assert s.request_finished(r, [1, 2]) == (True, None)        # the worker may still write into them
    s.update_connector_output(NS(finished_sending=None, finished_recving={"d"}))
    r2 = request("d2", 30, {C.P_PREFILL: True, C.P_KEY: "k2"})
    s.get_num_new_matched_tokens(r2, 0)
    s.update_state_after_alloc(r2, blocks([3, 4]), 30)
    s.build_connector_meta(output())
    s.update_connector_output(NS(finished_sending=None, finished_recving={"d2"}))
    assert s.request_finished(r2, [3, 4]) == (False, None)      # loaded, then finished normally


def test_settings_are_checked():
    with pytest.raises(ValueError, match="sidecar"):
        C.Settings.from_extra({})
    with pytest.raises(ValueError, match="unknown"):
        C.Settings.from_extra({"sidecar": "h:1", "sidcar": "typo"})
    s = C.Settings.from_extra({"sidecar": "h:1", "flow": "false", "load_timeout_s": "2.5", "checksum": False})
    assert (s.flow, s.load_timeout_s, s.checksum) == (False, 2.5, False)
    with pytest.raises(ValueError):
        C.transfer_priority({C.P_PRIORITY: "urgent"})
