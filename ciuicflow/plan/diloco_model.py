"""``ciuicflow plan --diloco H``: what ``ciuicflow.diloco`` costs per inner step.

Inside a node every step is exact DDP over the node's G GPUs (a ring all-reduce of the gradients).
Every H inner steps each of the F fragments (1/F of the parameters) crosses nodes once: local rank
``i`` of every node exchanges shard ``i`` (1/G of the fragment) with its peers through the codec's
plan (``compression.policy.wire_plan`` over the nodes, the exchange ``wire_cost`` costs), the G
ranks of a node sharing its link, then the node all-gathers the shards in float32. A sync runs while
the next D inner steps compute (``fragment_sync_delay``), so only what outlasts them is exposed.
Its local work is never hidden (it takes the device the inner steps run on): the codec's passes
over the shard, costed as the hooks' (``Workload.local_seconds_per_element``), and DiLoCo's own over
the whole fragment (``OWN_PASSES``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ciuicflow import formats
from ciuicflow.compression import policy, registry
from ciuicflow.plan.alpha_beta import _scatter_or_gather
from ciuicflow.plan.inputs import ClusterSpec, Workload
from ciuicflow.plan.wire_cost import flat_ring, quantized_exchange

EXACT = ("exact", "allreduce")
# DiLoCo's own memory traffic per element of a fragment at each sync, in units of the codec's that
# local_seconds_per_element stands for (about ten float32 passes): the pseudo-gradient (two reads,
# a write), the finite check (a read), the outer step (three) and the write-back (two): nine
OWN_PASSES = 0.9


@dataclass(frozen=True)
class DiLoCoEstimate:
    sync_every: int
    fragments: int
    delay: int
    codec: str
    wire: str                      # what the outer exchange sends (the policy's plan)
    inter_bytes_per_sync: float    # per node, one fragment's sync
    inter_bytes_per_step: float    # per node, averaged over the inner steps
    sync_seconds: float            # one fragment's sync: inter-node exchange and node gather
    local_seconds: float           # one fragment's sync: the codec's and DiLoCo's passes
    exposed_seconds_per_step: float
    step_seconds: float

    @property
    def name(self) -> str:
        return f"diloco {self.codec} H={self.sync_every} F={self.fragments} D={self.delay}"

    def as_dict(self) -> dict:
        return {**self.__dict__, "name": self.name}


def inter_node_exchange(c: ClusterSpec, numel: float, codec: str, chunk: int | None = None,
                        values_share: float = 1.0):
    """(seconds, bytes each exchanging rank sends, the plan's summary) of one shard of ``numel``
    elements averaged over the nodes, the node's G ranks sharing its link (1 bit's values counted
    on ``values_share`` of its chunks, as ``wire_cost`` does)."""
    n = c.nodes
    bw, lat = c.inter_goodput / c.gpus_per_node, c.inter_latency
    if n == 1:
        return 0.0, 0.0, "nothing crosses nodes"
    if codec in EXACT:
        seconds = 2 * _scatter_or_gather(n, numel * 4, bw, lat)
        return seconds, 2 * (n - 1) / n * numel * 4, "exact float32 ring"
    cost = registry.FAMILIES[codec].cost
    chunk = chunk or cost.chunk_size
    plan = policy.wire_plan(codec, exchange_ranks=n, route="flat", options={"chunk_size": chunk})
    per_elem = formats.bytes_per_element(plan.codec, chunk) \
        + 3 * plan.values * values_share / chunk
    served = registry.served_bytes_per_element(plan.server_codec, chunk) * numel \
        if plan.phases == 2 and plan.server_codec else None
    seconds, sent = quantized_exchange(n, numel * per_elem, bw, lat, plan.phases == 1, {},
                                       served=served)
    return seconds, sent, plan.summary()


def diloco(c: ClusterSpec, w: Workload, sync_every: int, fragments: int = 1, delay: int = 0,
           codec: str = "int8") -> DiLoCoEstimate:
    if sync_every < 1 or not 1 <= fragments <= sync_every or not 0 <= delay < sync_every:
        raise ValueError("DiLoCo needs sync_every >= 1, 1 <= fragments <= sync_every and "
                         "0 <= fragment_sync_delay < sync_every")
    if codec not in EXACT and (codec not in registry.FAMILIES
                               or registry.FAMILIES[codec].cost.kind != "quantized"):
        raise ValueError(f"unknown DiLoCo codec {codec!r}")
    g = c.gpus_per_node
    shard = w.params / fragments / g
    seconds, sent, wire = inter_node_exchange(c, shard, codec, w.chunk_size, w.values_share)
    gather = _scatter_or_gather(g, g * shard * 4, c.intra_bw, c.intra_latency)
    sync = seconds + gather
    codec_elements = 0.0 if codec in EXACT else shard
    local = (codec_elements + OWN_PASSES * w.params / fragments) * w.local_seconds_per_element
    inner = ClusterSpec(1, g, c.intra_bw, c.inter_bw, c.intra_latency, c.inter_latency,
                        backend=c.backend)
    ddp_seconds = flat_ring(inner, w.params * w.grad_bytes)[0]
    step_compute = w.compute_seconds * w.accum + ddp_seconds * (1 - w.overlap)
    exposed = fragments * (max(0.0, sync - delay * step_compute) + local) / sync_every
    return DiLoCoEstimate(sync_every, fragments, delay, codec, wire, sent * g,
                          sent * g * fragments / sync_every, sync, local, exposed,
                          step_compute + exposed)
