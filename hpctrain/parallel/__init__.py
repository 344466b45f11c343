"""Parallel transforms (one module each, ONE public entry) and the orchestrator over them.

``plan.py`` builds the validated ParallelPlan; ``orchestrator.apply_plan(plan, ...)``
applies the transforms in their fixed order and returns a Parallelized. ``wrap(strategy,
...)`` is the shorthand entry of the Python API. Modules are imported lazily so that
``single`` never needs Horovod and ``plan`` needs no torch.
"""

from __future__ import annotations

__all__ = ["STRATEGIES", "wrap", "Parallelized", "OptimizerFactory"]


def __getattr__(name):
    # Lazy: parallel.plan must import without torch (config checks run before it loads).
    if name == "STRATEGIES":
        # The shorthand strategy names wrap() takes (the registry's). zero1-3: one
        # transform, three presets (zero.options_for fills in or checks the stage); pipeline
        # takes a LayerStack (models.registry.build_layers) or an nn.Sequential; tensor:
        # TensorOptions, else the model's tp_plan.
        from hpctrain.registry import STRATEGIES

        return STRATEGIES
    if name in ("Parallelized", "OptimizerFactory"):
        from hpctrain.parallel import base

        return getattr(base, name)
    raise AttributeError(f"module 'hpctrain.parallel' has no attribute {name!r}")


def wrap(strategy: str, model, make_optimizer, world, options=None, mesh: str = "",
         dp_flavour: str = "", data=None):
    """Apply the named strategy (a one-dimensional plan; with ``mesh``/``dp_flavour`` a
    composed one) to model and optimizer through the orchestrator (collective over the
    world). ``options`` is the strategy's own options object (ZeroOptions, PipelineOptions,
    ...); a zero stage contradicting the name is a ValueError before any collective.
    ``data``: the run's data (orchestrator.RunData), which the pipeline probes (balance =
    "measured", a user module's split)."""
    import importlib

    from hpctrain import registry
    from hpctrain.parallel.orchestrator import apply_plan
    from hpctrain.parallel.plan import build_plan

    if strategy not in registry.STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of "
                         f"{', '.join(registry.STRATEGIES)}")
    if strategy in registry.FLAVOUR_NAMES:  # a preset's options checked before the world is touched
        module = importlib.import_module(registry.flavour(strategy).module)
        if hasattr(module, "options_for"):
            options = module.options_for(strategy, options)
    if strategy == "single" and world is not None and world.size > 1:
        from hpctrain.parallel import single

        return single.wrap(model, make_optimizer, world)  # its own error names the fix
    pipeline_mesh = getattr(options, "mesh", "") if strategy == "pipeline" else ""
    if pipeline_mesh and not isinstance(pipeline_mesh, str):
        pipeline_mesh = pipeline_mesh.describe()
    plan = build_plan(strategy, mesh or pipeline_mesh, world.size, dp_flavour,
                      getattr(options, "dp_sharding", "ddp") if strategy == "pipeline" else "ddp")
    table = registry.STRATEGY_TABLE.get(strategy)
    return apply_plan(plan, model, make_optimizer, world, {table: options} if table else {},
                       data=data)
