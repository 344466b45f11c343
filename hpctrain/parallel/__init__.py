"""Parallel strategies: one module each, each with ONE public ``wrap`` entry.

``wrap(model, make_optimizer, world, options)`` returns a Parallelized. Strategy modules
are imported lazily so that ``single`` never needs Horovod.
"""

from __future__ import annotations

import importlib

from hpctrain.parallel.base import OptimizerFactory, Parallelized

__all__ = ["STRATEGY_MODULES", "wrap", "Parallelized", "OptimizerFactory"]

STRATEGY_MODULES = {
    "single": "hpctrain.parallel.single",
    "ddp": "hpctrain.parallel.ddp",
    # One module, three presets: strategy_options() gives ZeroOptions(stage=N).
    "zero1": "hpctrain.parallel.zero",
    "zero2": "hpctrain.parallel.zero",
    "zero3": "hpctrain.parallel.zero",
    # wrap() takes a LayerStack (models.registry.build_layers), not a built model.
    "pipeline": "hpctrain.parallel.pipeline",
    "domain": "hpctrain.parallel.domain.strategy",
    "fsdp": "hpctrain.parallel.fsdp",
}


def wrap(strategy: str, model, make_optimizer: OptimizerFactory, world, options=None) -> Parallelized:
    """Apply the named strategy to model and optimizer (collective over the world)."""
    if strategy not in STRATEGY_MODULES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGY_MODULES)}")
    return importlib.import_module(STRATEGY_MODULES[strategy]).wrap(model, make_optimizer, world, options)
