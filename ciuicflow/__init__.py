"""ciuicflow: communication middleware for distributed PyTorch.

The public names are loaded on first use (PEP 562), so ``import ciuicflow.kvflow`` does not pull in
torch.distributed machinery, and ``import ciuicflow`` stays cheap.
"""
from importlib import import_module

from ciuicflow.compression import registry as _registry

__version__ = "0.1.0"

# public name -> module that defines it; every method's hook and state come from the registry
_EXPORTS = {
    "ops": "ciuicflow.ops",
    "Topology": "ciuicflow.topology",
    "hierarchical_all_reduce": "ciuicflow.collectives.hierarchical",
    "onebit_all_reduce": "ciuicflow.compression.onebit",
    "explain": "ciuicflow.compression.policy",
    "WirePlan": "ciuicflow.compression.policy",
    **{name: "ciuicflow.ddp.hooks" for name in _registry.METHODS},
    **{entry.state: "ciuicflow.ddp.hooks" for entry in _registry.ENTRIES},
    "register": "ciuicflow.ddp.hooks",
    "monitor": "ciuicflow.monitor",
    "Monitor": "ciuicflow.monitor.monitor",
    "optim": "ciuicflow.optim",
    "OneBitAdam": "ciuicflow.optim.onebit_adam",
    "ZeroOneAdam": "ciuicflow.optim.zero_one_adam",
    "diloco": "ciuicflow.diloco",
    "DiLoCo": "ciuicflow.diloco.diloco",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ciuicflow' has no attribute {name!r}")
    module = import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
