"""THE rule: what a quantising method's tensor carries on the wire, in one function.

``wire_plan(...)`` takes every input the choice depends on, explicitly: the method's family and
route, the state's options, the exchange's ranks, whether the nodes are whole with several ranks,
the tensors' device and whether an adaptive optimizer (Adam, ...) steps them. It returns a
``WirePlan``: the workers' codec, one phase or two, the route, and the servers' codec. The
compressors (and through them DDP, FSDP and the 1-bit optimizers) and ``ciuicflow plan`` read it;
``ciuicflow.explain`` prints it. Why each default is what it is: docs/decisions.md.

The rule today, in its options' defaults ("auto"):
1. Route: a hierarchical method is exact inside nodes and exchanges between them; a flat state
   with ``route="auto"`` takes that route too where the nodes are whole and hold several ranks.
2. Codec: the family's own (1 bit with values for concentrated windows on the all-reduce
   routes); for an adaptive optimizer's tensors the 1-bit family sends topmark where each value
   is quantised once and the tensor is on a CPU, int4 elsewhere (``adaptive_optimizer``).
3. Phases: one (each value quantised once) up to two ranks, up to the family's
   ``one_phase_ranks`` for its own codec, and for an adaptive codec where one phase saves a third
   of two phases' bytes; else two, whose servers send the family's ``server_family``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ciuicflow import formats
from ciuicflow.compression.registry import ADAPTIVE_CODECS, FAMILIES, METHODS, VALUES_MAX_CHUNK, Cost

ADAPTIVE_AUTO = ("topmark", "int4")  # "auto": (where each value is quantised once, twice)
ADAPTIVE_OPTIMIZER_POLICIES = ("auto", *ADAPTIVE_CODECS, "same")
ROUTE_POLICIES = ("auto", "flat")
# "auto" picks a codec only on the devices its kernels have run on (decisions.md)
ADAPTIVE_CODEC_DEVICES = {"topmark": ("cpu",)}
# one phase for an adaptive codec beyond two ranks only where it saves this share of two phases'
# bytes (decisions.md)
ADAPTIVE_ONE_PHASE_SAVING = 1 / 3


@dataclass(frozen=True)
class WirePlan:
    """What one tensor's exchange sends. ``codec``: the workers' ("exact" where nothing is
    compressed); ``phases``: 1 (every rank gathers every packed tensor: each value quantised
    once) or 2 (each rank serves a segment: its mean quantised again, with ``server_codec``);
    ``route``: "hierarchical" (exact inside nodes), "flat" or "reduce_scatter"; ``reasons``: why,
    a line per decision."""

    method: str
    route: str
    exchange_ranks: int
    codec: str
    phases: int
    server_codec: str = ""
    values: int = 0  # values a chunk of a concentrated window also sends (compression.outliers)
    reasons: tuple = field(default=(), compare=False)

    @property
    def family(self) -> str:
        return family_of(self.method)

    @property
    def sends_target(self) -> bool:
        """Whether every byte goes in the family's own codec (1 bit for the 1-bit family)."""
        return self.codec == self.family and self.server_codec in ("", self.family)

    def summary(self) -> str:
        """One short line: "onebit+values, hierarchical, 1 phase"."""
        if self.codec == "exact" or self.phases == 1 and self.codec == "powersgd":
            return f"{self.codec}, {self.route}"
        served = f" (servers {self.server_codec})" if self.phases == 2 and \
            self.server_codec not in ("", self.codec) else ""
        return (f"{self.codec}{'+values' if self.values else ''}, {self.route}, {self.phases} "
                f"phase{'s' if self.phases == 2 else ''}{served}")

    def describe(self) -> str:
        values = f" (+ up to {self.values} values per concentrated chunk)" if self.values else ""
        served = f", the servers send {self.server_codec}" if self.phases == 2 else ""
        return (f"{self.method}: {self.codec}{values} over {self.exchange_ranks} exchanging ranks "
                f"({self.route}), {self.phases} phase{'s' if self.phases == 2 else ''}{served}"
                + "".join(f"\n  - {why}" for why in self.reasons))

    def as_dict(self) -> dict:
        return {"method": self.method, "route": self.route, "exchange_ranks": self.exchange_ranks,
                "codec": self.codec, "values": self.values, "phases": self.phases,
                "server_codec": self.server_codec, "sends_target": self.sends_target,
                "reasons": list(self.reasons)}


def family_of(method_or_family: str) -> str:
    return method_or_family if method_or_family in FAMILIES else METHODS[method_or_family].family


def adaptive_codec_name(policy: str, quantised_once: bool, device_type: str | None = None) -> str:
    """The codec an ``adaptive_optimizer`` policy sends with ("same": the compressor's own) where
    each value is ``quantised_once`` or twice, from ``device_type`` (None: any)."""
    if policy != "auto":
        return policy
    name = ADAPTIVE_AUTO[0 if quantised_once else 1]
    if device_type is not None and device_type not in ADAPTIVE_CODEC_DEVICES.get(name, (device_type,)):
        return ADAPTIVE_AUTO[1]
    return name


def adaptive_one_phase(ranks: int, chunk: int, device_type: str | None = None) -> bool:
    """Whether "auto" sends an adaptive optimizer's tensor over ``ranks`` (> 2) ranks in one
    phase: where the once-quantised codec to every other rank, (ranks - 1) copies, costs at most
    1 - ``ADAPTIVE_ONE_PHASE_SAVING`` of the twice-quantised one in two phases, 2 (ranks - 1) /
    ranks copies."""
    once, twice = (adaptive_codec_name("auto", q, device_type) for q in (True, False))
    return once != twice and ranks * formats.bytes_per_element(once, chunk) \
        <= 2 * (1 - ADAPTIVE_ONE_PHASE_SAVING) * formats.bytes_per_element(twice, chunk)


def two_phases(phases, ranks: int, cost: Cost, adaptive_policy: str | None = None, chunk: int = 0,
               device_type: str | None = None) -> bool:
    """Whether a quantising exchange with option ``phases`` ("auto", 1 or 2) over ``ranks`` ranks
    has two phases, for the family's own codec (``adaptive_policy`` None or "same") or an adaptive
    optimizer's codec under that policy."""
    if phases != "auto":
        return phases == 2
    if ranks <= 2:
        return False
    if adaptive_policy in (None, "same"):
        return ranks > cost.one_phase_ranks
    return not (adaptive_policy == "auto" and adaptive_one_phase(ranks, chunk, device_type))


def served_codec_family(phases, server_codec: str, cost: Cost, ranks: int) -> str:
    """What the servers of a two-phase exchange of the family's own codec pack with ("": that
    codec): under ``phases="auto"`` the family's ``server_family`` beyond ``one_phase_ranks``
    (or the one ``server_codec`` names); with ``phases=2`` only the one ``server_codec`` names."""
    if server_codec == "same":
        return ""
    if phases == "auto":
        family = cost.server_family if ranks > max(2, cost.one_phase_ranks) else ""
        return family and (family if server_codec == "auto" else server_codec)
    return "" if server_codec == "auto" else server_codec


def wire_plan(method: str, *, exchange_ranks: int, route: str = "hierarchical",
              whole_nodes: bool = False, hierarchical_ranks: int | None = None,
              device_type: str | None = None, adaptive: bool = False,
              options: dict | None = None) -> WirePlan:
    """The plan of one tensor's exchange (the module docstring's rule). ``method``: a method or
    family name of the registry; ``route``: the hook's ("hierarchical", "flat") or
    "reduce_scatter" (FSDP's compressed reduce-scatter, each value quantised once);
    ``exchange_ranks``: ranks of the exchange on that route; ``whole_nodes``: the nodes are whole
    and hold several ranks, where ``hierarchical_ranks`` (fewer) would exchange after an exact
    node sum; ``adaptive``: an adaptive optimizer steps the tensor; ``options``: the state's
    (``phases``, ``server_codec``, ``adaptive_optimizer``, ``route``, ``outliers``, ``chunk_size``)."""
    family = family_of(method)
    cost = FAMILIES[family].cost
    options = options or {}
    reasons = []
    ranks = exchange_ranks
    route_policy = options.get("route") or cost.route
    if route == "flat" and route_policy == "auto" and whole_nodes and hierarchical_ranks \
            and hierarchical_ranks < ranks:
        route, ranks = "hierarchical", hierarchical_ranks
        reasons.append("route='auto': whole nodes of several ranks take the exact node sum first, "
                       "so fewer ranks exchange and each value is quantised fewer times")
    if cost.kind != "quantized":
        return WirePlan(method, route, ranks, "exact" if cost.kind == "exact" else family,
                        1, "", 0, tuple(reasons))
    chunk = int(options.get("chunk_size") or cost.chunk_size)
    phases_option = options.get("phases", "auto")
    policy = options.get("adaptive_optimizer") or cost.adaptive_family or "same"
    use_adaptive = adaptive and cost.adaptive_family and policy != "same"
    scatter = route == "reduce_scatter"
    if use_adaptive:
        twice = not scatter and two_phases(phases_option, ranks, cost, policy, chunk, device_type)
        codec = adaptive_codec_name(policy, not twice, device_type)
        reasons.append(f"an adaptive optimizer steps it: adaptive_optimizer={policy!r} sends "
                       f"{codec} where each value is quantised {'twice' if twice else 'once'}")
        return WirePlan(method, route, ranks, codec, 2 if twice else 1, codec if twice else "",
                        0, tuple(reasons))
    codec, values = family, 0 if scatter else _outlier_count(options, cost, chunk)
    twice = not scatter and two_phases(phases_option, ranks, cost, None, chunk, device_type)
    server = ""
    if twice:
        server = served_codec_family(phases_option, options.get("server_codec", "auto"), cost,
                                     ranks) or codec
        reasons.append(f"{ranks} ranks exchange in two phases (phases={phases_option!r}); the "
                       f"servers send {server}")
    else:
        reasons.append(f"{ranks} ranks exchange in one phase: each value quantised once")
    return WirePlan(method, route, ranks, codec, 2 if twice else 1, server, values, tuple(reasons))


def _outlier_count(options: dict, cost: Cost, chunk: int) -> int:
    """Values per concentrated chunk on an all-reduce route: the ``outliers`` option ("auto": the
    registry's), none where a position would not fit a byte."""
    outliers = options.get("outliers", "auto")
    count = cost.values if outliers == "auto" else int(outliers)
    return count if chunk <= VALUES_MAX_CHUNK else 0


def explain(method: str, *, nodes: int, ranks_per_node: int = 1, device: str = "cuda",
            optimizer: str = "sgd", **options) -> WirePlan:
    """What ``method``'s default state (or one with ``options``) sends from ``device`` tensors
    stepped by ``optimizer`` ("sgd", or an adaptive one: "adam", "adamw", ...) on ``nodes`` nodes
    of ``ranks_per_node`` ranks: the ``WirePlan`` of a bucket, as the compressors take it."""
    from ciuicflow.compression.registry import method as find_method
    route = find_method(method).route
    world = nodes * ranks_per_node
    ranks = nodes if route == "hierarchical" else world
    return wire_plan(method, exchange_ranks=ranks, route=route,
                     whole_nodes=nodes > 1 and ranks_per_node > 1, hierarchical_ranks=nodes,
                     device_type=device, adaptive=optimizer.lower() != "sgd", options=options)
