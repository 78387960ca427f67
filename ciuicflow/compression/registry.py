"""Every compression method, once: the one place a method's name is written.

The DDP hooks and their states, the FSDP path, ``plan``, ``doctor``, ``demo`` and the benches read
this table; a new compressor is its module plus one ``Entry`` here. This module imports neither
torch nor the compressors (only the byte layouts, ``ciuicflow.formats``) (``plan`` and ``doctor`` run without them): an entry names its
compressor class by path, loaded on first use.

A method is a compressor on a route: ``hierarchical`` (exact inside nodes, the compressor's
exchange between nodes) or ``flat`` (the exchange over the whole group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module

from ciuicflow import formats

ROUTES = ("hierarchical", "flat")


@dataclass(frozen=True)
class Cost:
    """What the cost model (``ciuicflow plan``) needs to know of a compressor's traffic.

    ``kind``: "exact" (float values), "quantized" (``payload_bits`` per element plus a float32
    scale per ``chunk_size`` elements, sent with the two-phase or one-phase exchange of
    ``compression.quantized``; ``adaptive_family``, if set, its ``adaptive_optimizer`` default:
    "auto", the policy's ladder for an adaptive optimizer's tensors) or "lowrank"
    (PowerSGD's factors at ``rank``). These are also the compressors' defaults: their classes read
    them from here."""

    kind: str
    payload_bits: int = 32
    adaptive_family: str = ""
    chunk_size: int = 0
    rank: int = 0
    # PowerSGD's rank for the tensors an adaptive optimizer steps, as a multiple of ``rank``
    adaptive_rank_factor: int = 1
    guard_threshold: float = 0.0
    # ranks of an all-reduce exchange up to which the compressor's own codec goes in one phase
    # (each rank's packed tensor to every other: each value quantised once, (W-1) packed copies per
    # rank); beyond, two phases (2(W-1)/W copies) whose server quantises each segment's mean again
    one_phase_ranks: int = 2
    # beyond ``one_phase_ranks`` (phases "auto"), the family whose codec the servers pack each
    # segment's mean with ("": the compressor's own): 1 bit's servers send int4
    server_family: str = ""
    values: int = 0  # values a chunk of a concentrated window also sends on the all-reduce
    #                   routes, 24 bits each (compression.outliers; only such chunks carry
    #                   them), in chunks of at most VALUES_MAX_CHUNK elements
    # the flat state's default route (its ``route`` option): "flat", because a method's name says
    # its route; "auto" (an opt-in) takes the hierarchical route where the nodes are whole and
    # hold several ranks (an exact node sum, then fewer ranks exchange)
    route: str = "flat"

# a value's position within its chunk is one byte (compression.outliers)
VALUES_MAX_CHUNK = 256

# What a compressor with an ``adaptive_family`` (1-bit) can send an adaptive optimizer's tensors
# as, its ``adaptive_optimizer`` option (their layouts: ``ciuicflow.formats``, which ``plan`` costs
# them by; tests check the codecs agree); "same": the compressor's own codec.
ADAPTIVE_CODECS = ("int4", "int8")


def adaptive_bytes_per_element(policy: str, chunk: int) -> float:
    """Bytes per element of an adaptive codec (``ADAPTIVE_CODECS``) with the compressor's
    ``chunk``-element chunks: payload and scales (``formats.bytes_per_element``)."""
    return formats.bytes_per_element(policy, chunk)


@dataclass(frozen=True)
class Entry:
    family: str          # the compressor's name: "onebit"
    compressor: str      # "module:Class", loaded on first use
    state: str           # the name of its DDP state class
    methods: dict        # route -> method (hook) name
    summary: str         # what it sends, in a few words
    cost: Cost
    advice: str = ""     # when a user would pick it (doctor, docs)

    def compressor_class(self):
        module, _, name = self.compressor.partition(":")
        return getattr(import_module(module), name)


@dataclass(frozen=True)
class Method:
    name: str
    entry: Entry = field(repr=False)
    route: str

    @property
    def family(self) -> str:
        return self.entry.family

    @property
    def compresses(self) -> bool:
        return self.entry.cost.kind != "exact"

    @property
    def hierarchical(self) -> bool:
        return self.route == "hierarchical"

    @property
    def description(self) -> str:
        if self.hierarchical:
            return f"exact inside nodes, {self.entry.summary} between nodes" \
                if self.compresses else self.entry.summary
        return f"{self.entry.summary}, over the whole group (no topology)"


# ranks up to which 1 bit goes in one phase, and what its servers send beyond (docs/decisions.md)
ONE_PHASE_RANKS = 4

SERVER_FAMILY = "int4"
# the share of a segment's chunks the "onebit_int4" server codec sends as int4 (compression.refined)
REFINED_SHARE = 0.1
# what the 1-bit servers may send (a quantising state's server_codec, besides "auto" and "same")
SERVED_FAMILIES = ("int4", "onebit_int4")


def served_bytes_per_element(family: str, chunk: int) -> float:
    """Bytes per element of what servers send with ``family``'s codec in ``chunk``-element chunks:
    int4's, or "onebit_int4"'s (1 bit and a scale per chunk, and for ``REFINED_SHARE`` of the
    chunks a side block of 3 bits per element of a ``VALUES_MAX_CHUNK``-element chunk)."""
    if family == "onebit_int4":
        return 1 / 8 + 4 / chunk + REFINED_SHARE * (3 * VALUES_MAX_CHUNK / 8) / chunk
    return adaptive_bytes_per_element(family, chunk)


ENTRIES = (
    Entry("allreduce", "ciuicflow.compression.base:ExactCompressor", "AllReduceState",
          {"hierarchical": "hierarchical_allreduce"},
          "exact mean: intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather",
          Cost("exact"),
          "exact; the baseline, and the choice on one node or fast inter-node links"),
    Entry("onebit", "ciuicflow.compression.onebit:OneBitCompressor", "OneBitState",
          {"hierarchical": "hierarchical_1bit", "flat": "onebit"},
          "1-bit signs with a scale per chunk and error feedback",
          Cost("quantized", payload_bits=1, adaptive_family="auto", chunk_size=formats.DEFAULT_CHUNK_SIZE,
               guard_threshold=4.0, values=4, one_phase_ranks=ONE_PHASE_RANKS,
               server_family=SERVER_FAMILY),
          "the most compression with SGD (21-28x on two nodes, 11-19x on three and four, about 11x "
          "beyond); under Adam-family optimizers its buckets go as int4 (about 7.5x), raised to int8 "
          "where their measured noise says so; watch the accuracy guard"),
    Entry("powersgd", "ciuicflow.compression.powersgd:PowerSGDCompressor", "PowerSGDState",
          {"hierarchical": "hierarchical_powersgd", "flat": "powersgd"},
          "rank-r PowerSGD factors with error feedback and warm start",
          Cost("lowrank", rank=16, adaptive_rank_factor=2, guard_threshold=200.0),
          "models made mostly of large matrices (transformers, MLPs)"),
    Entry("int8", "ciuicflow.compression.int8:Int8Compressor", "Int8State",
          {"hierarchical": "hierarchical_int8", "flat": "int8"},
          "int8 values with a scale per chunk and error feedback",
          Cost("quantized", payload_bits=8, adaptive_family="auto", chunk_size=formats.DEFAULT_CHUNK_SIZE,
               guard_threshold=4.0),
          "about 4x with almost no error; where 1-bit's error costs accuracy"),
    Entry("int4", "ciuicflow.compression.int4:Int4Compressor", "Int4State",
          {"hierarchical": "hierarchical_int4", "flat": "int4"},
          "4-bit values with a scale per chunk and error feedback",
          Cost("quantized", payload_bits=4, adaptive_family="auto", chunk_size=formats.DEFAULT_CHUNK_SIZE,
               guard_threshold=4.0),
          "about 7.5x with little error: what the 1-bit methods send Adam-family optimizers' "
          "tensors as"),
)

METHODS: dict[str, Method] = {
    name: Method(name, entry, route)
    for entry in ENTRIES for route, name in entry.methods.items()
}
FAMILIES: dict[str, Entry] = {entry.family: entry for entry in ENTRIES}


def method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {sorted(METHODS)}") from None


def compressed_methods() -> list[str]:
    return [name for name, m in METHODS.items() if m.compresses]
