"""KV-flow: a sidecar that moves KV-cache data between inference servers, and its client.

``Client(address)`` talks to the sidecar beside this process (``ciuicflow-sidecar``, see
``ciuicflow.kvflow.sidecar``); ``docs/kvflow.md`` describes flags, protocol, statuses, metrics and the code.
"""
from .client.client import Client
from .client.payload import KVFlowError, Part, RecvHeader, SendResult
from .client.streams import RecvStream, SendHandle, SendStream

__all__ = ["Client", "KVFlowError", "Part", "RecvHeader", "RecvStream", "SendHandle", "SendResult", "SendStream"]
