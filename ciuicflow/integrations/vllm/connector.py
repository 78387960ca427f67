"""``CiuicFlowConnector``: vLLM's v1 KV connector API over the KV-flow sidecar. vLLM builds one per role:
in its scheduler (``SchedulerSide``, scheduler.py) and in each worker (``WorkerSide``, worker.py); this
class only routes each call to the side it belongs to. See docs/vllm.md."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .config import Settings
from .metadata import CiuicFlowMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("ciuicflow.vllm")
if not log.handlers:
    # vLLM configures only its own "vllm" logger: without a handler ours would show warnings only
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [ciuicflow.vllm pid %(process)d] %(message)s"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)
    log.propagate = False


class CiuicFlowConnector(KVConnectorBase_V1):
    """Disaggregated prefill/decode through ciuicflow's sidecar (one per node, ``sidecar`` in the extra
    config: this instance's own sidecar's local API)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = Settings.from_extra(tc.kv_connector_extra_config)
        producer, consumer = bool(tc.is_kv_producer), bool(tc.is_kv_consumer)
        block_size = vllm_config.cache_config.block_size
        self._sched: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.settings, block_size, producer, consumer)
        else:
            num_blocks = getattr(kv_cache_config, "num_blocks", None) if kv_cache_config is not None else None
            self._worker = WorkerSide(self.settings, num_blocks)
        log.info("CiuicFlowConnector %s (%s): sidecar %s, load %s", role.name, tc.kv_role, self.settings.sidecar,
                 self.settings.load_mode)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.meta = connector_metadata if isinstance(connector_metadata, CiuicFlowMetadata) else None

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.meta = None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: "Request") -> None:
        self._sched.on_new_request(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> CiuicFlowMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list):
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()
