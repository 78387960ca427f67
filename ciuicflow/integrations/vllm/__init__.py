"""vLLM disaggregated prefill/decode over ciuicflow's KV-flow sidecar (docs/vllm.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CiuicFlowConnector",
        "kv_connector_module_path": "ciuicflow.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"sidecar": "127.0.0.1:50151", "peer": "decode0"}}'

- ``CiuicFlowConnector`` (connector.py: scheduler side in scheduler.py, worker side in worker.py, the
  transfer format in transfer.py, settings in config.py): imported only on first use, so that the proxy
  (proxy.py), the demo (``ciuicflow vllm-demo``, demo.py) and the tests load without vLLM.
"""
from importlib import import_module

_EXPORTS = {"CiuicFlowConnector": ".connector", "CiuicFlowMetadata": ".metadata", "Settings": ".config"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
