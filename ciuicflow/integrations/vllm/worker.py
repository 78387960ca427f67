"""The connector's worker side (runs where the model runs): sends each layer's blocks to the sidecar as
soon as the layer has run, loads received blocks into this instance's paged KV cache, and reports what
finished and what failed.

Contract with vLLM, and how it is kept:
- ``save_kv_layer`` gathers (copies) the request's blocks of that layer and appends them to the sidecar at
  once; ``wait_for_save`` ends each request's transfer. The scheduler side holds the blocks (delay_free)
  until ``get_finished`` reports the send done: when the destination sidecar holds every chunk, or failed.
- async loads run in a thread per request (``IncomingKV``) and are reported by ``get_finished`` when the
  thread has stopped, successful or not; failed ones' blocks go to ``get_block_ids_with_load_errors`` in
  that same pass, so vLLM recomputes them (or fails the request), never uses them.
- layerwise loads: ``wait_for_layer_load`` blocks until that layer's blocks are written (or the load has
  failed); failures are reported in the same step, and vLLM discards that step's output for the request.
- Every wait is bounded by ``load_timeout_s``; nothing here raises into vLLM's forward pass.
"""
from __future__ import annotations

import collections
import logging
import re
import time
from typing import Dict, List, Optional, Set

from ciuicflow.kvflow.sidecar.grpc_setup import FAST_RECONNECT

from . import config as C
from .phases import log_phase
from .outgoing import OutgoingKV
from .transfer import IncomingKV, block_dim, block_shape, gather

log = logging.getLogger("ciuicflow.vllm")


# the sidecar's channels: own subchannels, reconnecting within a second (grpc_setup.FAST_RECONNECT)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                   ("grpc.use_local_subchannel_pool", 1), *FAST_RECONNECT]


def make_client(settings: C.Settings):
    """A Client of this instance's sidecar whose channels reconnect within a second after the sidecar
    restarts. Client's own channels share gRPC's global subchannel pool and default backoff (up to 2
    minutes of calls failing at once after an outage), and it takes no channel options: until it does,
    its channels are replaced here (same target and message limits), when it has the expected attributes."""
    import grpc
    from ciuicflow.kvflow import Client
    client = Client(settings.sidecar, token=settings.api_token or None, flow=settings.flow)
    try:
        from ciuicflow.kvflow.proto import kvflow_pb2_grpc as pb_grpc
        for chan, stub in (("_channel", "_stub"), ("_high_channel", "_high_stub")):
            if hasattr(client, chan) and hasattr(client, stub):
                old = getattr(client, chan)
                setattr(client, chan, grpc.insecure_channel(settings.sidecar, options=CHANNEL_OPTIONS))
                setattr(client, stub, pb_grpc.KVFlowStub(getattr(client, chan)))
                old.close()
    except Exception as exc:  # noqa: BLE001 - the plain Client still works, only reconnects slower
        log.debug("keeping the Client's own channels: %s", exc)
    return client


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class WorkerSide:
    def __init__(self, settings: C.Settings, num_blocks: Optional[int] = None, client=None):
        self.s = settings
        self.num_blocks = num_blocks
        self._client = client
        self.caches: Dict[str, object] = {}
        self.dims: Dict[str, int] = {}
        self.layer_names: List[str] = []
        self.layer_index: Dict[str, int] = {}
        self._out: Dict[str, OutgoingKV] = {}           # this step's sends
        self._sending: Dict[str, OutgoingKV] = {}       # ended, waiting for the destination's ack
        self._finished: Set[str] = set()                # finished per the scheduler, send still pending
        self._loads: Dict[str, IncomingKV] = {}         # async loads in flight
        self._step_sync: List[IncomingKV] = []          # this step's layerwise loads
        self._aborted: Set[str] = set()
        self._errors: Set[int] = set()
        self.meta = None
        self._old_clients: list = []
        self.recent = collections.deque(maxlen=64)     # (req_id, ok, priority) of the last loads, for debugging
        self.stats = {"sent": 0, "send_failed": 0, "loaded": 0, "load_failed": 0}

    @property
    def client(self):
        if self._client is None:
            self._client = make_client(self.s)
        return self._client

    def _maybe_reconnect(self, error) -> None:
        # A gRPC channel that failed to connect backs off (up to minutes) and fails every call at once
        # meanwhile: after the sidecar restarts, a fresh Client reaches it at the next request. The old
        # one may still serve other transfers; it is closed at shutdown.
        code = getattr(error, "code", None)
        if self._client is not None and getattr(code, "name", "") == "UNAVAILABLE":
            self._old_clients.append(self._client)
            self._client = None

    def register_kv_caches(self, kv_caches: Dict[str, object]) -> None:
        # One order on both sides, whatever the dict's: layer names sorted by their numbers.
        self.layer_names = sorted(kv_caches, key=_natural_key)
        self.layer_index = {n: i for i, n in enumerate(self.layer_names)}
        for name, cache in kv_caches.items():
            n = self.num_blocks
            if n and cache.shape[0] != n and cache.shape[0] % n == 0 and (cache.dim() < 2 or cache.shape[1] != n):
                cache = cache.unflatten(0, (n, -1))     # kernel blocks inside vLLM's blocks: a view
            self.caches[name] = cache
            self.dims[name] = block_dim(cache, n)
        first = kv_caches[self.layer_names[0]] if self.layer_names else None
        log.info("CiuicFlowConnector: %d KV layers, cache %s %s, block dim %d, sidecar %s", len(self.layer_names),
                 tuple(first.shape) if first is not None else None, getattr(first, "dtype", None),
                 self.dims.get(self.layer_names[0], 0) if self.layer_names else 0, self.s.sidecar)

    # ------------------------------------------------------------------ prefill side
    def save_kv_layer(self, layer_name: str, kv_layer) -> None:
        meta = self.meta
        if meta is None or not meta.saves or layer_name not in self.layer_index:
            return
        cache = self.caches[layer_name]
        dim = self.dims[layer_name]
        # kv_layer is the registered cache's storage in another view (MLA: 3-D here, 4-D registered): gather
        # from the registered view, so that both sides agree on the block shape.
        src = cache
        if kv_layer is not None and kv_layer.data_ptr() != cache.data_ptr() and kv_layer.numel() == cache.numel():
            src = kv_layer.reshape(cache.shape)
        shape = block_shape(cache, dim)
        for spec in meta.saves:
            out = self._out.get(spec.req_id)
            if out is None:
                out = self._out[spec.req_id] = OutgoingKV(
                    self.client, spec.req_id, spec.key, spec.dest, spec.block_ids, spec.num_tokens,
                    spec.tokens_sha, self.layer_names, spec.priority, spec.deadline_s, spec.flow,
                    self.s.checksum, spec.corrupt_layer if spec.corrupt_layer >= 0 else self.s.test_corrupt_layer)
            if out.error is None:
                try:
                    blocks = gather(src, spec.block_ids, dim).reshape([len(spec.block_ids), *shape])
                except Exception as exc:  # noqa: BLE001
                    out.fail(exc)
                    continue
                out.add_layer(self.layer_index[layer_name], blocks)

    def wait_for_save(self) -> None:
        meta = self.meta
        for spec in (meta.saves if meta is not None else ()):
            out = self._out.pop(spec.req_id, None)
            if out is None:          # no layer was saved (should not happen): a failed send, reported as done;
                                     # the decode side finds no transfer and recomputes after its timeout
                out = OutgoingKV(self.client, spec.req_id, spec.key, spec.dest, spec.block_ids, spec.num_tokens,
                                 spec.tokens_sha, self.layer_names)
            out.close()
            self._sending[spec.req_id] = out
        self._out.clear()
        for inc in self._step_sync:
            # layerwise: the forward waited for every layer; the thread ends right after its last part
            inc.done.wait(max(0.0, inc.deadline + 5.0 - time.monotonic()))
            if not inc.done.is_set():
                inc.cancel("timed out after the forward")
                inc.done.wait(5.0)
            self._account(inc)
        self._step_sync = []

    # ------------------------------------------------------------------ decode side
    def start_load_kv(self) -> None:
        meta = self.meta
        if meta is None:
            return
        for key, source in meta.drains:
            # a transfer this instance does not need: received into no blocks, so the sidecar frees it now
            IncomingKV(self.client, f"drain:{key}", key, self.caches, self.layer_names, [], 0, 0, "",
                       self.s.load_timeout_s, self.dims, source=source, drain=True).start()
        for spec in meta.loads:
            inc = IncomingKV(self.client, spec.req_id, spec.key, self.caches, self.layer_names, spec.block_ids,
                             spec.first_block, spec.num_tokens, spec.tokens_sha, spec.timeout_s, self.dims,
                             sent_blocks=spec.sent_blocks, source=spec.source, checksum=self.s.checksum).start()
            if spec.sync:
                self._step_sync.append(inc)
            else:
                self._loads[spec.req_id] = inc

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._step_sync:
            return
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        for inc in self._step_sync:
            inc.wait_layer(index)

    def _account(self, inc: IncomingKV) -> None:
        self.recent.append((inc.req_id, inc.error is None, inc.priority))
        if not inc.drain:
            log_phase("load", inc.key, ok=inc.error is None, priority=inc.priority, t_start=inc.t_start,
                      t_first=inc.t_first, t_end=inc.t_start + ((inc.finished_at or time.monotonic()) - inc.started))
        if inc.error is None:
            self.stats["loaded"] += 1
            log.info("loaded KV of request %s (%d blocks, priority %s) in %.3fs", inc.req_id,
                     len(inc.block_ids) - inc.first_block, inc.priority, (inc.finished_at or time.monotonic()) - inc.started)
        else:
            self.stats["load_failed"] += 1
            self._maybe_reconnect(inc.error)
            if inc.req_id not in self._aborted:
                self._errors.update(inc.failed_block_ids())

    # ------------------------------------------------------------------ both
    def get_finished(self, finished_req_ids: Set[str]):
        for req_id in finished_req_ids:
            if req_id in self._sending:
                self._finished.add(req_id)
            inc = self._loads.get(req_id)
            if inc is not None:          # aborted while loading: stop writing into its blocks
                self._aborted.add(req_id)
                inc.cancel("request finished")
        sent = set()
        for req_id in list(self._finished):
            out = self._sending[req_id]
            if out.done():
                sent.add(req_id)
                self._finished.discard(req_id)
                del self._sending[req_id]
                self.stats["send_failed" if out.error is not None else "sent"] += 1
                log_phase("send", out.key, ok=out.error is None, priority=out.priority, flow=out.flow,
                          bytes=out.nbytes, t_open=out.t_open, t_close=out.t_close, t_done=out.t_done,
                          append_s=out.append_s)
                if out.error is not None:
                    self._maybe_reconnect(out.error)
        recved = set()
        for req_id, inc in list(self._loads.items()):
            inc.check_deadline()
            if inc.done.is_set():
                del self._loads[req_id]
                self._account(inc)
                self._aborted.discard(req_id)
                recved.add(req_id)
        return sent or None, recved or None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._errors = self._errors, set()
        if errors:
            log.warning("reporting %d KV blocks that failed to load", len(errors))
        return errors

    def shutdown(self) -> None:
        for inc in list(self._loads.values()) + self._step_sync:
            inc.cancel("shutdown")
        for c in self._old_clients + ([self._client] if self._client is not None else []):
            try:
                c.close()
            except Exception:  # noqa: BLE001
                pass
