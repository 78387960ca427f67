"""The connector's scheduler side (runs in vLLM's scheduler process): decides which requests send or load
their KV, tells the worker side through ``CiuicFlowMetadata``, and keeps blocks alive while a transfer
may still touch them.

Prefill (kv_producer): a request whose ``kv_transfer_params`` has ``do_remote_decode`` is sent in the step
that computes its last prompt token (all of its prompt's blocks, chunked prefill included).
``request_finished`` then holds its blocks (delay_free) until the worker reports the send done, and returns
the ``kv_transfer_params`` the proxy forwards to the decode instance.

Decode (kv_consumer): a request with ``do_remote_prefill`` and a ``ciuic_key`` loads the prompt's KV:
asynchronously by default (the request waits in WAITING_FOR_REMOTE_KVS while other requests keep decoding;
vLLM recomputes the last prompt token to sample the next one), or ``load_mode: layerwise``, where the
first forward waits for each layer as it arrives (whole blocks of ``prompt - 1`` tokens; the tail is
computed). A load is tried once: after a failure (reported by the worker through
``get_block_ids_with_load_errors``) vLLM recomputes or fails the request, by its ``kv_load_failure_policy``.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Set

from . import config as C
from .metadata import CiuicFlowMetadata, LoadSpec, SaveSpec
from .transfer import tokens_sha

log = logging.getLogger("ciuicflow.vllm")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SchedulerSide:
    def __init__(self, settings: C.Settings, block_size: int, producer: bool, consumer: bool):
        self.s = settings
        self.block_size = int(block_size)
        self.producer = producer
        self.consumer = consumer
        self._send_candidates: Dict[str, Any] = {}      # req_id -> Request (do_remote_decode, not sent yet)
        self._blocks: Dict[str, list] = {}              # req_id -> its block ids so far (send candidates)
        self._sent: Dict[str, SaveSpec] = {}            # req_id -> spec: handed to the worker to send
        self._sending: Set[str] = set()                 # finished requests whose blocks wait for the send
        self._load_tried: Set[str] = set()              # a load was planned once: never again (recompute)
        self._recv_inflight: Set[str] = set()           # loads handed to the worker, not reported finished
        self._pending_loads: list = []
        self._pending_drains: list = []
        self._delayed_recv: Set[str] = set()            # finished while their load was still in flight

    # ------------------------------------------------------------------ decode side
    def _load_params(self, request) -> Optional[dict]:
        params = request.kv_transfer_params or {}
        if not self.consumer or not params.get(C.P_PREFILL) or not params.get(C.P_KEY):
            return None
        if request.request_id in self._load_tried:
            return None
        return params

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = self._load_params(request)
        if params is None:
            return 0, False
        prompt = len(request.prompt_token_ids or [])
        sent = params.get(C.P_TOKENS)
        if sent is not None and int(sent) != prompt:
            return 0, False         # another prompt: computed here (and the transfer drained)
        if self.s.load_mode == "async":
            n = prompt - num_computed_tokens
            return (n, True) if n > 0 else (0, False)
        # layerwise: whole blocks, leaving at least the last prompt token to compute in this forward
        n = ((prompt - 1) // self.block_size) * self.block_size - num_computed_tokens
        return (n, False) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = self._load_params(request)
        if params is None:
            return
        req_id = request.request_id
        self._load_tried.add(req_id)
        if num_external_tokens <= 0:
            # computed here after all (a prompt of one block in layerwise mode, a local prefix hit, another
            # prompt): the prefill side sent it anyway; collect and drop it rather than leave it to the
            # decode sidecar's lease
            self._pending_drains.append((str(params[C.P_KEY]), params.get(C.P_SOURCE) or None))
            return
        prompt_ids = list(request.prompt_token_ids or [])
        block_ids = list(blocks.get_block_ids()[0])
        if self.s.load_mode == "async":
            local = len(prompt_ids) - num_external_tokens
            upto = _cdiv(len(prompt_ids), self.block_size)
        else:
            local = ((len(prompt_ids) - 1) // self.block_size) * self.block_size - num_external_tokens
            upto = (local + num_external_tokens) // self.block_size
        spec = LoadSpec(req_id=req_id, key=str(params[C.P_KEY]), block_ids=block_ids[:upto],
                        sent_blocks=_cdiv(len(prompt_ids), self.block_size),
                        first_block=local // self.block_size, num_tokens=len(prompt_ids),
                        tokens_sha=tokens_sha(prompt_ids), timeout_s=self.s.load_timeout_s,
                        sync=self.s.load_mode == "layerwise", source=params.get(C.P_SOURCE) or None)
        self._pending_loads.append(spec)
        if not spec.sync:
            # A layerwise load ends inside its step (the forward waits for it); an async one may outlive
            # the request (an abort), so its blocks must stay allocated until the worker reports it.
            self._recv_inflight.add(req_id)

    # ------------------------------------------------------------------ prefill side
    def on_new_request(self, request) -> None:
        params = request.kv_transfer_params or {}
        if self.producer and (params.get(C.P_DECODE) or self.s.send_all):
            self._send_candidates[request.request_id] = request

    def _save_spec(self, request, block_ids: list) -> Optional[SaveSpec]:
        params = request.kv_transfer_params or {}
        dest = params.get(C.P_DEST) or self.s.peer
        if not dest:
            log.warning("request %s: no destination (kv_transfer_params %s or extra config 'peer'): not sent",
                        request.request_id, C.P_DEST)
            return None
        prompt_ids = list(request.prompt_token_ids or [])
        try:
            priority = C.transfer_priority(params, int(getattr(request, "priority", 0) or 0))
        except ValueError as exc:
            log.warning("request %s: %s; sending at normal priority", request.request_id, exc)
            priority = "normal"
        return SaveSpec(req_id=request.request_id, key=str(params.get(C.P_KEY) or request.request_id), dest=dest,
                        block_ids=list(block_ids[:_cdiv(len(prompt_ids), self.block_size)]),
                        num_tokens=len(prompt_ids), tokens_sha=tokens_sha(prompt_ids), priority=priority,
                        deadline_s=C.transfer_deadline(params, self.s.send_deadline_s),
                        flow=C.transfer_flow(params, self.s.flow),
                        corrupt_layer=int(params.get(C.P_TEST_CORRUPT, -1)) if self.s.test_faults else -1)

    def _track_saves(self, scheduler_output, meta: CiuicFlowMetadata) -> None:
        scheduled = scheduler_output.num_scheduled_tokens
        progress = []      # (req_id, tokens computed once this step ran)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._send_candidates:
                self._blocks[new.req_id] = list(new.block_ids[0])
                progress.append((new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._send_candidates:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                self._blocks.setdefault(req_id, []).extend(new_ids[0])
            progress.append((req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)))
        for req_id, computed in progress:
            request = self._send_candidates[req_id]
            if computed < len(request.prompt_token_ids or []):
                continue            # chunked prefill: sent in the step that completes the prompt
            del self._send_candidates[req_id]
            spec = self._save_spec(request, self._blocks.pop(req_id, []))
            if spec is not None:
                self._sent[req_id] = spec
                meta.saves.append(spec)

    # ------------------------------------------------------------------ both
    def build_connector_meta(self, scheduler_output) -> CiuicFlowMetadata:
        meta = CiuicFlowMetadata()
        if self.producer:
            self._track_saves(scheduler_output, meta)
        meta.loads, self._pending_loads = self._pending_loads, []
        meta.drains, self._pending_drains = self._pending_drains, []
        return meta

    def update_connector_output(self, output) -> None:
        for req_id in output.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in output.finished_recving or ():
            self._recv_inflight.discard(req_id)
            self._delayed_recv.discard(req_id)

    def request_finished(self, request, block_ids):
        req_id = request.request_id
        self._send_candidates.pop(req_id, None)
        self._blocks.pop(req_id, None)
        self._load_tried.discard(req_id)
        if req_id in self._recv_inflight:
            # Aborted while its KV was still being written into its blocks: they stay allocated until the
            # worker has stopped that load (it sees the request in finished_req_ids) and reports it.
            self._delayed_recv.add(req_id)
            return True, None
        spec = self._sent.pop(req_id, None)
        if spec is None:
            return False, None
        self._sending.add(req_id)
        return True, {C.P_PREFILL: True, C.P_KEY: spec.key, C.P_TOKENS: spec.num_tokens,
                      C.P_SOURCE: self.s.name or None, C.P_PRIORITY: spec.priority}

    def has_pending_push_work(self) -> bool:
        return bool(self._sending)
