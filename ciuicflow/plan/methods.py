"""The strategies the planner models, and the hooks' parameters it assumes."""

# method names: to be read from the compression registry
STRATEGIES = ("flat_ring", "hierarchical", "hierarchical_1bit", "hierarchical_powersgd", "onebit", "powersgd")
EXACT_STRATEGIES = ("flat_ring", "hierarchical")
RANKED = ("hierarchical_powersgd", "powersgd")

# bench/comm.py method -> (strategy, gradient bytes per element on the wire)
BENCH_METHODS = {
    "allreduce": ("flat_ring", 4), "fp16_compress_hook": ("flat_ring", 2), "powerSGD_hook": ("powersgd", 4),
    "hierarchical_allreduce": ("hierarchical", 4), "hierarchical_1bit": ("hierarchical_1bit", 4),
    "hierarchical_powersgd": ("hierarchical_powersgd", 4), "onebit": ("onebit", 4), "powersgd": ("powersgd", 4),
}

# the hooks' defaults, which the model assumes (tests/test_plan.py checks that they agree)
ONEBIT_CHUNK = 256  # elements per scale of the 1-bit hooks
POWERSGD_RANK = 16  # the PowerSGD hooks' rank
