"""The strategies the planner models: the exact all-reduces and every compressing method of the
compression registry, for DDP and for FSDP2 sharded inside the node, with the registry's defaults."""
from ciuicflow.compression import registry


def cost(strategy: str) -> registry.Cost:
    """The registry's cost description of a compressing strategy (an FSDP one's: its method's)."""
    return registry.method(strategy.removeprefix("fsdp_")).entry.cost


def hierarchical(strategy: str) -> bool:
    return registry.method(strategy.removeprefix("fsdp_")).hierarchical


EXACT_STRATEGIES = ("flat_ring", "hierarchical", "fsdp_hsdp")
STRATEGIES = EXACT_STRATEGIES[:2] + tuple(registry.compressed_methods())  # DDP's: the default set
# FSDP2 sharded inside the node: its own HSDP, or a hierarchical method of the registry (ciuicflow.fsdp)
FSDP_STRATEGIES = ("fsdp_hsdp",) + tuple(
    "fsdp_" + name for name in registry.compressed_methods() if registry.method(name).hierarchical)
ALL_STRATEGIES = STRATEGIES + FSDP_STRATEGIES
RANKED = tuple(name for name in ALL_STRATEGIES
               if name not in EXACT_STRATEGIES and cost(name).kind == "lowrank")

# bench/comm.py method -> (strategy, gradient bytes per element on the wire)
BENCH_METHODS = {
    "allreduce": ("flat_ring", 4), "fp16_compress_hook": ("flat_ring", 2),
    "powerSGD_hook": (registry.FAMILIES["powersgd"].methods["flat"], 4),
    registry.FAMILIES["allreduce"].methods["hierarchical"]: ("hierarchical", 4),
    **{name: (name, 4) for name in STRATEGIES[2:]},
}
# bench/fsdp.py method -> strategy
FSDP_BENCH_METHODS = {"hsdp": "fsdp_hsdp",
                      registry.FAMILIES["allreduce"].methods["hierarchical"]: "fsdp_hsdp",
                      **{s.removeprefix("fsdp_"): s for s in FSDP_STRATEGIES[1:]}}

POWERSGD_RANK = registry.FAMILIES["powersgd"].cost.rank  # the rank when none is given
