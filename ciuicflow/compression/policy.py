"""THE rule: what a quantising method's tensor carries on the wire, in one function.

``wire_plan(...)`` takes every input the choice depends on, explicitly: the method's family and
route, the state's options, the exchange's ranks, whether the nodes are whole with several ranks,
whether an adaptive optimizer (Adam, ...) steps the tensor and how far its measured noise has
raised it (the same from every device). It returns a ``WirePlan``: the workers' codec, one phase
or two, the route, and the servers' codec. The
compressors (and through them DDP, FSDP and the 1-bit optimizers) and ``ciuicflow plan`` read it;
``ciuicflow.explain`` prints it. Why each default is what it is: docs/decisions.md.

The rule, in its options' defaults ("auto"):
1. Route: the method's. A hierarchical method is exact inside nodes and exchanges between them; a
   flat one exchanges over every rank (``route="auto"`` opts in to the node sum on whole nodes).
2. Codec: the family's own (1 bit with values for concentrated windows on the all-reduce
   routes). A tensor an adaptive optimizer steps is quantised in that optimizer's units (each
   coordinate divided by the root mean square the optimizer divides it by, multiplied back
   after: the rounding noise lands evenly where the optimizer looks) and climbs
   ``ADAPTIVE_LADDER`` (int4, then int8; int8's family starts there): it is raised one rung when
   its measured noise, the guard's ||error memory|| / ||input|| in those units (the largest over
   the exchanging ranks, so every rank decides alike), stays above ``TOLERANCE`` for
   ``PATIENCE`` steps, and never lowered. Sign compression's noise is far above any tolerance
   there, which is why the ladder starts at int4.
3. Phases: one (each value quantised once) up to two ranks, and up to the family's
   ``one_phase_ranks`` for its own codec; else two, whose servers send the family's
   ``server_family`` (or the workers' codec).
4. DiLoCo's outer exchange (``outer_wire``): rule 2's codec for the inner optimizer's kind, synced
   every (its bits / ``OUTER_BITS_PER_STEP``) inner steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ciuicflow.compression.registry import ADAPTIVE_CODECS, FAMILIES, METHODS, VALUES_MAX_CHUNK, Cost
from ciuicflow.compression.registry import method as find_method

# "auto" for an adaptive optimizer's tensors: the rungs a tensor climbs while its noise in the
# optimizer's units stays above TOLERANCE for PATIENCE steps (docs/decisions.md)
ADAPTIVE_LADDER = ("int4", "int8")
TOLERANCE = 0.5  # noise at half the signal's size: the optimizer's RMS inflated by at most 12%
PATIENCE = 5
ADAPTIVE_OPTIMIZER_POLICIES = ("auto", *ADAPTIVE_CODECS, "same")
# DiLoCo's outer exchange under "auto" (``outer_wire``): bits per parameter per inner step
OUTER_BITS_PER_STEP = 0.25
ROUTE_POLICIES = ("auto", "flat")


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
    rungs_left: int = 0  # rungs of its ladder above this codec (``climb``)
    in_units: bool = False  # quantised in the optimizer's units (an adaptive optimizer's tensor)

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
                "rungs_left": self.rungs_left, "in_units": self.in_units,
                "reasons": list(self.reasons)}


def family_of(method_or_family: str) -> str:
    return method_or_family if method_or_family in FAMILIES else METHODS[method_or_family].family


def adaptive_ladder(family: str) -> tuple:
    """The rungs an adaptive optimizer's tensor climbs under ``family``'s method: from the
    family's own precision where it is on ``ADAPTIVE_LADDER``, else from its first rung."""
    return ADAPTIVE_LADDER[ADAPTIVE_LADDER.index(family):] if family in ADAPTIVE_LADDER \
        else ADAPTIVE_LADDER


def climb(plan: WirePlan, rung: int, over: int, noise: float | None) -> tuple[int, int]:
    """(rung, steps over the tolerance) after a step that sent ``plan`` and measured ``noise`` in
    the optimizer's units: one rung up after ``PATIENCE`` steps in a row above ``TOLERANCE``."""
    if plan is None or not plan.rungs_left or noise is None:
        return rung, over
    if noise <= TOLERANCE:
        return rung, 0
    if over + 1 >= PATIENCE:
        return rung + 1, 0
    return rung, over + 1


def two_phases(phases, ranks: int, cost: Cost, own_codec: bool = True) -> bool:
    """Whether a quantising exchange with option ``phases`` ("auto", 1 or 2) over ``ranks`` ranks
    has two phases: "auto" takes one up to two ranks (the same bytes, no second quantisation), and
    up to the family's ``one_phase_ranks`` for its ``own_codec``."""
    if phases != "auto":
        return phases == 2
    if ranks <= 2:
        return False
    return not own_codec or ranks > cost.one_phase_ranks


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
              adaptive: bool = False, options: dict | None = None, rung: int = 0) -> WirePlan:
    """The plan of one tensor's exchange (the module docstring's rule). ``method``: a method or
    family name of the registry; ``route``: the hook's ("hierarchical", "flat") or
    "reduce_scatter" (FSDP's compressed reduce-scatter, each value quantised once);
    ``exchange_ranks``: ranks of the exchange on that route; ``whole_nodes``: the nodes are whole
    and hold several ranks, where ``hierarchical_ranks`` (fewer) would exchange after an exact
    node sum; ``adaptive``: an adaptive optimizer steps the tensor; ``options``: the state's
    (``phases``, ``server_codec``, ``adaptive_optimizer``, ``route``, ``outliers``,
    ``chunk_size``); ``rung``: how far the tensor has climbed its ladder (``climb``)."""
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
        ladder = adaptive_ladder(family) if policy == "auto" else (policy,)
        codec = ladder[min(rung, len(ladder) - 1)]
        twice = not scatter and two_phases(phases_option, ranks, cost, codec == family)
        # a reduce-scatter packs other ranks' shards, whose units this rank does not hold
        units = "in plain units (a reduce-scatter)" if scatter else \
            "quantised in the optimizer's units"
        reasons.append(
            f"an adaptive optimizer steps it: {units}, rung "
            f"{min(rung, len(ladder) - 1) + 1} of {' -> '.join(ladder)} (raised while its noise "
            f"in the optimizer's units stays above {TOLERANCE})" if len(ladder) > 1 else
            f"an adaptive optimizer steps it: adaptive_optimizer={policy!r} sends {codec}, {units}")
        return WirePlan(method, route, ranks, codec, 2 if twice else 1, codec if twice else "",
                        0, tuple(reasons), len(ladder) - 1 - min(rung, len(ladder) - 1),
                        not scatter)
    codec, values = family, 0 if scatter else _outlier_count(options, cost, chunk)
    twice = not scatter and two_phases(phases_option, ranks, cost)
    server = ""
    if twice:
        server = served_codec_family(phases_option, options.get("server_codec", "auto"), cost,
                                     ranks) or codec
        reasons.append(f"{ranks} ranks exchange in two phases (phases={phases_option!r}); the "
                       f"servers send {server}")
    else:
        reasons.append(f"{ranks} ranks exchange in one phase: each value quantised once")
    return WirePlan(method, route, ranks, codec, 2 if twice else 1, server, values, tuple(reasons))


def outer_wire(codec, sync_every, sgd: bool, optimizer_name: str = "") -> tuple[str, int, str]:
    """(codec, sync_every, why) of DiLoCo's outer exchange (``ciuicflow.diloco``). ``codec="auto"``:
    what ``wire_plan`` sends for a tensor of the 1-bit family that the inner optimizer steps: 1 bit
    where it is SGD (``sgd``: a sum of gradients, as the hooks send them), int4 under
    any other optimizer or none given (a sum of normalised steps, as the hooks send an adaptive
    optimizer's tensors). ``sync_every="auto"``: the codec's payload bits / ``OUTER_BITS_PER_STEP``
    (1 bit every 4 steps, int4 every 16, int8 every 32, exact every 128): every codec at the same
    bytes per step, so a coarser codec syncs more often and its model drifts less between syncs.
    (The codec does not hang on the number of nodes; its phases do, planned by the compressor.)"""
    why = []
    if codec == "auto":
        codec = wire_plan("onebit", exchange_ranks=2, route="flat", adaptive=not sgd).codec
        why.append(f"codec='auto': {codec}, what the 1-bit hooks send for a tensor "
                   f"{'SGD steps' if sgd else 'an adaptive optimizer steps'} "
                   f"(inner optimizer: {optimizer_name or 'none given'})")
    if sync_every == "auto":
        bits = FAMILIES[codec].cost.payload_bits if codec in FAMILIES else 32  # exact
        sync_every = max(1, round(bits / OUTER_BITS_PER_STEP))
        why.append(f"sync_every='auto': {sync_every}, so that {bits} bit(s) per parameter per "
                   f"sync are {OUTER_BITS_PER_STEP:g} bit per parameter per inner step")
    return codec, sync_every, "; ".join(why)


def _outlier_count(options: dict, cost: Cost, chunk: int) -> int:
    """Values per concentrated chunk on an all-reduce route: the ``outliers`` option ("auto": the
    registry's), none where a position would not fit a byte."""
    outliers = options.get("outliers", "auto")
    count = cost.values if outliers == "auto" else int(outliers)
    return count if chunk <= VALUES_MAX_CHUNK else 0


def explain(method: str, *, nodes: int, ranks_per_node: int = 1, device: str = "cuda",
            optimizer: str = "sgd", **options) -> WirePlan:
    """What ``method``'s default state (or one with ``options``) sends for tensors stepped by
    ``optimizer`` ("sgd", or an adaptive one: "adam", "adamw", ...) on ``nodes`` nodes of
    ``ranks_per_node`` ranks: the ``WirePlan`` a bucket starts with, as the compressors take it
    (an adaptive optimizer's may be raised later by its measured noise: ``rungs_left``). The rule
    sends the same from every ``device``."""
    route = find_method(method).route
    world = nodes * ranks_per_node
    ranks = nodes if route == "hierarchical" else world
    return wire_plan(method, exchange_ranks=ranks, route=route,
                     whole_nodes=nodes > 1 and ranks_per_node > 1, hierarchical_ranks=nodes,
                     adaptive=optimizer.lower() != "sgd", options=options)
