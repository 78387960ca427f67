"""The strategies the planner models: the exact all-reduces and every compressing method of the
compression registry, for DDP and for FSDP2 (sharded inside the node with HSDP, or over every rank),
with the registry's defaults."""
from ciuicflow.compression import registry


def cost(strategy: str) -> registry.Cost:
    """The registry's cost description of a compressing strategy (an FSDP one's: its method's)."""
    return registry.method(strategy.removeprefix("fsdp_")).entry.cost


def hierarchical(strategy: str) -> bool:
    return registry.method(strategy.removeprefix("fsdp_")).hierarchical


# FSDP2 over every rank compresses its reduce-scatter with the flat quantising methods: one
# all-to-all of packed rows (compression/quantized_scatter.py; ciuicflow.fsdp.state.scatter_methods()
# names the same ones from the compressors themselves, which the planner does not import)
SCATTER_METHODS = tuple(name for name in registry.compressed_methods()
                        if not registry.method(name).hierarchical
                        and registry.method(name).entry.cost.kind == "quantized")

EXACT_STRATEGIES = ("flat_ring", "hierarchical", "fsdp_hsdp", "fsdp")
STRATEGIES = EXACT_STRATEGIES[:2] + tuple(registry.compressed_methods())  # DDP's: the default set
# FSDP2 sharded inside the node: its own HSDP, or a hierarchical method of the registry (ciuicflow.fsdp)
HSDP_STRATEGIES = ("fsdp_hsdp",) + tuple(
    "fsdp_" + name for name in registry.compressed_methods() if registry.method(name).hierarchical)
# FSDP2 over every rank (a 1-D mesh): its own reduce-scatter, or ciuicflow's compressed one
ONE_DIM_STRATEGIES = ("fsdp",) + tuple("fsdp_" + name for name in SCATTER_METHODS)
FSDP_STRATEGIES = HSDP_STRATEGIES + ONE_DIM_STRATEGIES
ALL_STRATEGIES = STRATEGIES + FSDP_STRATEGIES
RANKED = tuple(name for name in ALL_STRATEGIES
               if name not in EXACT_STRATEGIES and cost(name).kind == "lowrank")

POWERSGD_RANK = registry.FAMILIES["powersgd"].cost.rank  # the rank when none is given


def default_rank(optimizer: str) -> int:
    """PowerSGD's default rank for a workload's optimizer: under an adaptive one ("adam") its
    tensors go at ``adaptive_rank``, a multiple of the rank (compression.powersgd)."""
    factor = registry.FAMILIES["powersgd"].cost.adaptive_rank_factor if optimizer == "adam" else 1
    return factor * POWERSGD_RANK
