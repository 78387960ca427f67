"""Training engines that drive ciuicflow's optimizers through an adapter of their own.

An engine's adapter (``ciuicflow.integrations.<engine>``) patches the engine so it knows how to
drive our optimizers; it is loaded only in processes that have imported the engine, when one of
our optimizers is built. Named here by module path, so the optimizers never import the
integrations (which import the optimizers).
"""
from __future__ import annotations

import sys
from importlib import import_module

# engine module -> adapter module with an idempotent install()
ADAPTERS = {"deepspeed": "ciuicflow.integrations.deepspeed"}


def prepare_engines() -> None:
    for engine, adapter in ADAPTERS.items():
        if engine in sys.modules:
            import_module(adapter).install()
