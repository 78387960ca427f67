"""Collectives over torch.distributed, independent of DDP and of any compressor.

- ``primitives``: counted collectives, ``Traffic``, ``Hop``, the non-finite flag (the leaf);
- ``routes``: ``FlatRoute`` / ``HierarchicalRoute``, the path a reduction takes;
- ``node_shm``: the shared-memory node sum of CPU tensors;
- ``hierarchical``: the exact all-reduces as functions.

Bytes are counted with the usual bandwidth-optimal model, per rank: an all-reduce of B bytes over
W ranks sends 2(W-1)/W * B, a reduce-scatter or all-gather (W-1)/W * B of the full buffer, an
all-to-all (W-1)/W * B. On a group that spans nodes, the share sent to peers on other nodes is the
share of those peers among the W-1 others. These are modelled bytes, not bytes measured on a wire.
"""
from ciuicflow.collectives.primitives import Hop, Traffic

__all__ = ["Hop", "Traffic"]
