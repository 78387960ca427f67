"""The connector's settings, from vLLM's ``kv_connector_extra_config``, and what a request's
``kv_transfer_params`` may carry. No vLLM import: the proxy, the demo and the tests read these too.

    --kv-transfer-config '{"kv_connector": "CiuicFlowConnector",
                           "kv_connector_module_path": "ciuicflow.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"sidecar": "127.0.0.1:50151", "peer": "decode0"}}'
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

PRIORITIES = ("high", "normal", "low")

# kv_transfer_params keys (the proxy sets them; vLLM hands them to the connector untouched)
P_DECODE = "do_remote_decode"        # prefill side: send this request's KV (vLLM's own name)
P_PREFILL = "do_remote_prefill"      # decode side: load this request's KV (vLLM's own name)
P_KEY = "ciuic_key"                  # the sidecar transfer key, equal on both sides
P_DEST = "ciuic_dest"                # prefill side: the decode sidecar's peer name (default: settings.peer)
P_PRIORITY = "ciuic_priority"        # "high" | "normal" | "low" (default: from vLLM's request priority)
P_DEADLINE = "ciuic_deadline_s"      # transfer deadline in seconds (the sidecar fails it after that)
P_FLOW = "x-ciuic-flow"              # "enabled" | "disabled": the sidecar's flow control for this transfer
P_TOKENS = "ciuic_num_tokens"        # prompt length the prefill side sent (checked by the decode side)
P_SOURCE = "ciuic_source"            # the prefill side's sidecar name (decode side: receive only from it)
P_TEST_CORRUPT = "ciuic_test_corrupt_layer"   # TEST ONLY (with test_faults): corrupt this layer in transit


@dataclass
class Settings:
    """``kv_connector_extra_config``. Only ``sidecar`` is required."""
    sidecar: str = ""                # this instance's own sidecar's local API, HOST:PORT
    peer: str = ""                   # prefill side: default destination (the decode sidecar's --name)
    name: str = ""                   # prefill side: this node's sidecar --name, sent along as ciuic_source so
                                     # the decode side receives the key only from it (sidecars that scope keys
                                     # by sender); empty: not sent
    api_token: str = ""              # the sidecar's --api-token, if it has one
    flow: bool = True                # x-ciuic-flow: enabled unless a request says otherwise
    load_mode: str = "async"         # "async": load between steps (others keep decoding); "layerwise": the
                                     # first forward waits for each layer as it arrives (wait_for_layer_load)
    load_timeout_s: float = 30.0     # decode side: a transfer not fully received by then fails (recompute)
    send_deadline_s: float = 0.0     # prefill side: default transfer deadline, 0 = none (see P_DEADLINE)
    checksum: bool = True            # crc32c of each layer's blocks, end to end (the sidecar checks chunks);
                                     # decode side: required (a transfer without them fails its load)
    send_all: bool = False           # producer: send every request, not only do_remote_decode ones
    test_corrupt_layer: int = -1     # TEST ONLY: prefill flips a byte of this layer after its checksum
    test_faults: bool = False        # TEST ONLY: honour the request's ciuic_test_corrupt_layer

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]]) -> "Settings":
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"CiuicFlowConnector: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        s = cls()
        for k, v in extra.items():
            default = getattr(s, k)
            if isinstance(default, bool):
                v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on", "enabled")
            elif isinstance(default, (int, float)):
                v = type(default)(v)
            else:
                v = str(v)
            setattr(s, k, v)
        if not s.sidecar:
            raise ValueError('CiuicFlowConnector needs kv_connector_extra_config {"sidecar": "HOST:PORT"} '
                             "(this instance's own sidecar's --api address)")
        if s.load_mode not in ("async", "layerwise"):
            raise ValueError(f"load_mode must be 'async' or 'layerwise', not {s.load_mode!r}")
        return s


def transfer_priority(params: Mapping[str, Any], vllm_priority: int = 0) -> str:
    """The sidecar priority of a request: ``ciuic_priority`` if given, else from vLLM's request priority
    (lower is more urgent there, 0 the default): < 0 high, 0 normal, > 0 low."""
    p = params.get(P_PRIORITY)
    if p is not None:
        if p not in PRIORITIES:
            raise ValueError(f"{P_PRIORITY} must be one of {PRIORITIES}, not {p!r}")
        return p
    return "high" if vllm_priority < 0 else ("low" if vllm_priority > 0 else "normal")


def transfer_flow(params: Mapping[str, Any], default: bool) -> bool:
    v = params.get(P_FLOW, params.get("ciuic_flow"))
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    return str(v).lower() in ("enabled", "1", "true", "on")


def transfer_deadline(params: Mapping[str, Any], default: float) -> Optional[float]:
    v = params.get(P_DEADLINE)
    v = float(v) if v is not None else float(default)
    return v if v > 0 else None
