"""What the scheduler side tells the worker side each step (``build_connector_meta``): which requests to
send (prefill) and which to load (decode). Plain dataclasses: vLLM pickles them to the worker process."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
except ImportError:             # the worker side's transfer tests run without vLLM
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class SaveSpec:
    req_id: str
    key: str
    dest: str
    block_ids: List[int]         # every block of the prompt, in order
    num_tokens: int              # prompt length
    tokens_sha: str
    priority: str
    deadline_s: Optional[float]
    flow: bool
    corrupt_layer: int = -1      # test only (extra config test_faults)


@dataclass
class LoadSpec:
    req_id: str
    key: str
    block_ids: List[int]         # this instance's blocks to fill (the prompt's, or its whole blocks)
    sent_blocks: int             # blocks in the transfer: all of the prompt's
    first_block: int             # blocks before it are already here (local prefix cache): not written
    num_tokens: int
    tokens_sha: str
    timeout_s: float
    sync: bool                   # layerwise: the forward waits for each layer (wait_for_layer_load)
    source: Optional[str] = None # the sending sidecar's name, when the prefill side told it


@dataclass
class CiuicFlowMetadata(KVConnectorMetadata):
    saves: List[SaveSpec] = field(default_factory=list)
    loads: List[LoadSpec] = field(default_factory=list)
    drains: List[tuple] = field(default_factory=list)    # (key, source): sent but not needed here: discard
