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
    ``compression.quantized``; ``adaptive_family``, if set, the family whose codec the compressor
    sends an adaptive optimizer's tensors with by default: its ``adaptive_optimizer``) or "lowrank"
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
    # the flat state's route (its ``route`` option): "auto" takes the hierarchical route where
    # the nodes are whole and hold several ranks (an exact node sum, then fewer ranks exchange:
    # each value quantised once on two nodes, half the inter-node bytes), "flat" never
    route: str = "flat"

# a value's position within its chunk is one byte (compression.outliers)
VALUES_MAX_CHUNK = 256

# What a compressor with an ``adaptive_family`` (1-bit) can send an adaptive optimizer's tensors
# as, its ``adaptive_optimizer`` option (their layouts: ``ciuicflow.formats``, which ``plan`` costs
# them by; tests check the codecs agree); "same": the compressor's own codec.
ADAPTIVE_CODECS = ("topmark", "int4", "int8", "twobit")
# "auto" (the 1-bit default): topmark where each value is quantised once (a one-phase all-reduce
# exchange: two ranks, and three, where that saves a third of int4's two phases' bytes,
# adaptive_one_phase; FSDP's compressed reduce-scatter), int4 elsewhere: where two phases quantise
# each value twice, topmark ended 2.1-2.7% above exact loss and int4 within 0.1%
# (docs/convergence.md, "The largest marked")
ADAPTIVE_AUTO = ("topmark", "int4")  # (each value quantised once, twice)
ADAPTIVE_OPTIMIZER_POLICIES = ("auto", *ADAPTIVE_CODECS, "same")
# a quantising state's ``route`` option (Cost.route)
ROUTE_POLICIES = ("auto", "flat")
# the device types "auto" may pick an adaptive codec on, where not every one: topmark's CUDA
# kernel has not yet run on a GPU (none was lent), so "auto" sends int4 from CUDA tensors
ADAPTIVE_CODEC_DEVICES = {"topmark": ("cpu",)}


def adaptive_codec_name(policy: str, quantised_once: bool, device_type: str | None = None) -> str:
    """The codec an ``adaptive_optimizer`` policy sends with ("same" for the compressor's own)
    where each value is ``quantised_once`` (a one-phase all-reduce exchange, the reduce-scatter)
    or twice (two phases), for tensors on ``device_type`` (None: any)."""
    if policy != "auto":
        return policy
    name = ADAPTIVE_AUTO[0 if quantised_once else 1]
    if device_type is not None and device_type not in ADAPTIVE_CODEC_DEVICES.get(name, (device_type,)):
        return ADAPTIVE_AUTO[1]
    return name


# "auto" exchanges an adaptive optimizer's tensor in one phase (each value quantised once, the
# finer codec) over more than two ranks only where that saves at least this share of the bytes of
# two phases: on three and four nodes alike it ended 0.4-1.5% above exact loss where int4 ended
# within 0.5% (docs/convergence.md, "More than two nodes"): worth 1.8x fewer bytes (three nodes),
# not 1.3x (four)
ADAPTIVE_ONE_PHASE_SAVING = 1 / 3


def adaptive_one_phase(ranks: int, chunk: int, device_type: str | None = None) -> bool:
    """Whether "auto" exchanges an adaptive optimizer's tensor over ``ranks`` (> 2) ranks in one
    phase: where the once-quantised codec sent to every other rank, (ranks - 1) copies, costs at
    most 1 - ``ADAPTIVE_ONE_PHASE_SAVING`` of the twice-quantised one in two phases, 2 (ranks - 1)
    / ranks copies. With topmark (1.56 bits per element) against int4 (4.13): 3 ranks (13.7x
    against int4's 7.8x; 4 ranks would save 24%, 10.2x)."""
    once, twice = (adaptive_codec_name("auto", q, device_type) for q in (True, False))
    return once != twice and ranks * adaptive_bytes_per_element(once, chunk) \
        <= 2 * (1 - ADAPTIVE_ONE_PHASE_SAVING) * adaptive_bytes_per_element(twice, chunk)


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


# 1 bit goes in one phase up to four exchanging ranks (nodes' sums, hierarchically): 1-bit SGD
# gradients (the hooks) and 1-bit Adam's momentum (ciuicflow.optim) alike. The server's second
# quantisation cost accuracy wherever it was measured. SGD, bench/convergence.py's
# cnn_sgd_cosine, gap to exact per seed, two phases -> one: 4 nodes x 2 ranks (seeds 0-3) -1.5 /
# -0.4 / -0.5 / -1.15 -> -0.5 / +0.25 / +0.05 / -0.5 pt; 4 x 1 -0.35 / -1.1 -> -0.3 / -0.4;
# 3 x 2 -0.6 / -0.95 -> -0.2 / -0.25; wide_mlp_bf16_step 4 x 1 -0.98 / -0.73 -> +0.1 / -0.1
# (docs/convergence.md, "More than two nodes under SGD"). Adam, charlm_adamw, one rank per node,
# seeds 0-2, mean / worst seed: three nodes 0/1 Adam +1.4% / +2.3% with two phases, +0.2% / +0.8%
# with one; four: 0/1 Adam +1.0% / +1.8% and 1-bit Adam +1.2% / +2.0% with two, +0.2% / +0.6% and
# +0.8% / +1.1% with one (docs/onebit_adam.md, "One phase up to four ranks"). The price: 1 bit at
# about 28x fewer bytes than float32 on two ranks, 19x on three, 14x on four (two phases: 28x on
# any W); with the hooks' values, on the CNN: 15x and 11x where two phases sent 22x. Beyond four
# ranks two phases (one phase's W-1 copies grow with W), with int4 at the server (below).
ONE_PHASE_RANKS = 4

# Beyond four ranks 1 bit's exchange has two phases, and its servers pack each segment's mean as
# int4, not 1 bit: the second 1-bit quantisation cost a point on eight nodes (the CNN, seeds 0-3,
# -0.95 / -0.8 / -1.1 / -1.2 pt; int4 at the server -0.5 / +0.2 / +0.05 / -0.25) at 1/12.9 of
# exact's bytes, int4 at the server 1/8.5 (docs/convergence.md, "Beyond four nodes"). The
# hooks' and HSDP's replicas' rule; the 1-bit optimizers keep 1 bit there (server_codec="same":
# within their line on six nodes, docs/onebit_adam.md).
SERVER_FAMILY = "int4"
# the share of a segment's chunks the "onebit_int4" server codec sends as int4 (compression.refined;
# an option, server_codec="onebit_int4": 1 bit's bytes, about half a point below exact on the CNN on
# eight nodes where int4 stays within a fifth; docs/convergence.md, "A tenth of the servers' chunks")
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


def served_family(cost: Cost, ranks: int) -> str:
    """The family whose codec the servers of an exchange of ``cost``'s own codec over ``ranks``
    ranks pack with, under ``phases="auto"``: its ``server_family`` beyond ``one_phase_ranks``
    (and two), else "" (the codec itself)."""
    return cost.server_family if ranks > max(2, cost.one_phase_ranks) else ""


def two_phases(phases, ranks: int, cost: Cost, adaptive_policy: str | None = None, chunk: int = 0,
               device_type: str | None = None) -> bool:
    """Whether a quantising state with option ``phases`` ("auto", 1 or 2) exchanges over ``ranks``
    ranks in two phases (each rank serves a segment: each value quantised twice). "auto": one
    phase up to two ranks; the state's own codec (``adaptive_policy`` None or "same") up to
    ``cost.one_phase_ranks``; an adaptive optimizer's codec under "auto" where
    ``adaptive_one_phase`` says so (``chunk``, ``device_type``), else two. The compressors' rule
    (QuantizedCompressor.two_phases) and the planner's."""
    if phases != "auto":
        return phases == 2
    if ranks <= 2:
        return False
    if adaptive_policy in (None, "same"):
        return ranks > cost.one_phase_ranks
    return not (adaptive_policy == "auto" and adaptive_one_phase(ranks, chunk, device_type))


def served_codec_family(phases, server_codec: str, cost: Cost, ranks: int) -> str:
    """What the servers of a two-phase exchange of ``cost``'s own codec over ``ranks`` ranks pack
    with, for a state's ``phases`` and ``server_codec`` options: under ``phases="auto"`` the
    ``server_family`` where it picked two phases (``served_family``), or the family
    ``server_codec`` names there; where ``phases=2`` asks for two phases, the named family only
    ("auto" then sends the state's own codec). "" is the state's own codec. The compressors' rule
    (QuantizedCompressor.server_codec_for) and the planner's."""
    if server_codec == "same":
        return ""
    if phases == "auto":
        family = served_family(cost, ranks)
        return family and (family if server_codec == "auto" else server_codec)
    return "" if server_codec == "auto" else server_codec


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
               guard_threshold=4.0, values=4, route="auto", one_phase_ranks=ONE_PHASE_RANKS,
               server_family=SERVER_FAMILY),
          "the most compression with SGD (21-28x: values where a gradient is concentrated; 11-19x on three and four nodes, which exchange in one phase; about 11x beyond, whose servers send int4, 22x with server_codec='onebit_int4' at about half a point); under Adam-family optimizers "
          "its buckets go as topmark (20x) where two nodes exchange CPU tensors, int4 (about 7.5x) elsewhere; watch "
          "the accuracy guard"),
    Entry("powersgd", "ciuicflow.compression.powersgd:PowerSGDCompressor", "PowerSGDState",
          {"hierarchical": "hierarchical_powersgd", "flat": "powersgd"},
          "rank-r PowerSGD factors with error feedback and warm start",
          Cost("lowrank", rank=16, adaptive_rank_factor=2, guard_threshold=200.0),
          "models made mostly of large matrices (transformers, MLPs)"),
    Entry("int8", "ciuicflow.compression.int8:Int8Compressor", "Int8State",
          {"hierarchical": "hierarchical_int8", "flat": "int8"},
          "int8 values with a scale per chunk and error feedback",
          Cost("quantized", payload_bits=8, chunk_size=formats.DEFAULT_CHUNK_SIZE, guard_threshold=4.0),
          "about 4x with almost no error; where 1-bit's error costs accuracy"),
    Entry("int4", "ciuicflow.compression.int4:Int4Compressor", "Int4State",
          {"hierarchical": "hierarchical_int4", "flat": "int4"},
          "4-bit values with a scale per chunk and error feedback",
          Cost("quantized", payload_bits=4, chunk_size=formats.DEFAULT_CHUNK_SIZE, guard_threshold=4.0),
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
