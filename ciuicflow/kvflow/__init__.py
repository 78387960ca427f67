"""KV-flow: a sidecar that moves KV-cache data between inference servers, and its client.

``Client(address)`` talks to the sidecar beside this process (``ciuicflow-sidecar``, see
``ciuicflow.kvflow.server``); ``docs/kvflow.md`` describes flags, protocol, statuses and metrics.
"""
from .client.client import Client, KVFlowError, Part, RecvHeader, RecvStream, SendHandle, SendResult, SendStream

__all__ = ["Client", "KVFlowError", "Part", "RecvHeader", "RecvStream", "SendHandle", "SendResult", "SendStream"]
