"""Parallel strategies: one module each, each with ONE public ``wrap`` entry.

``wrap(model, make_optimizer, world, options)`` returns a Parallelized. Strategy modules
are imported lazily so that ``single`` never needs Horovod. A module serving several names
(zero1-3) defines ``options_for(name, options)``, which makes the options agree with the name.
"""

from __future__ import annotations

import importlib

from hpctrain.parallel.base import OptimizerFactory, Parallelized

__all__ = ["STRATEGY_MODULES", "wrap", "Parallelized", "OptimizerFactory"]

STRATEGY_MODULES = {
    "single": "hpctrain.parallel.single",
    "ddp": "hpctrain.parallel.ddp",
    # One module, three presets: zero.options_for fills in (or checks) the stage.
    "zero1": "hpctrain.parallel.zero",
    "zero2": "hpctrain.parallel.zero",
    "zero3": "hpctrain.parallel.zero",
    # wrap() takes a LayerStack (models.registry.build_layers) or an nn.Sequential.
    "pipeline": "hpctrain.parallel.pipeline",
    "domain": "hpctrain.parallel.domain.strategy",
    "fsdp": "hpctrain.parallel.fsdp",
}


def wrap(strategy: str, model, make_optimizer: OptimizerFactory, world, options=None) -> Parallelized:
    """Apply the named strategy to model and optimizer (collective over the world)."""
    if strategy not in STRATEGY_MODULES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGY_MODULES)}")
    module = importlib.import_module(STRATEGY_MODULES[strategy])
    if hasattr(module, "options_for"):
        options = module.options_for(strategy, options)
    return module.wrap(model, make_optimizer, world, options)
