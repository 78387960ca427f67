"""The strategies the planner models: the two exact all-reduces and every compressing method of the
compression registry, with the registry's defaults (chunk sizes, ranks)."""
from ciuicflow.compression import registry

EXACT_STRATEGIES = ("flat_ring", "hierarchical")
STRATEGIES = EXACT_STRATEGIES + tuple(registry.compressed_methods())
RANKED = tuple(name for name in STRATEGIES[2:] if registry.method(name).entry.cost.kind == "lowrank")

# bench/comm.py method -> (strategy, gradient bytes per element on the wire)
BENCH_METHODS = {
    "allreduce": ("flat_ring", 4), "fp16_compress_hook": ("flat_ring", 2),
    "powerSGD_hook": (registry.FAMILIES["powersgd"].methods["flat"], 4),
    registry.FAMILIES["allreduce"].methods["hierarchical"]: ("hierarchical", 4),
    **{name: (name, 4) for name in STRATEGIES[2:]},
}

POWERSGD_RANK = registry.FAMILIES["powersgd"].cost.rank  # the rank when none is given


def cost(strategy: str) -> registry.Cost:
    """The registry's cost description of a compressing strategy."""
    return registry.method(strategy).entry.cost


def hierarchical(strategy: str) -> bool:
    return registry.method(strategy).hierarchical
