"""The orchestrator: a ParallelPlan in, one Parallelized out, transforms in a fixed order.

1. model-parallel transforms: tensor parallel (slot for the next one), domain layers;
2. activation checkpointing (per block; per layer inside the pipeline);
3. the pipeline split (this rank keeps its stages);
4. the data-parallel flavour (ddp, zero1-3, fsdp) over the dp replicas, summing gradients
   over the groups the model-parallel transforms say hold partial gradients.

Rank 0 logs one line per transform applied and the group it works over. The trainer, the
checkpoint package and the CLI see only the plan and what this returns; a transform never
imports another one, this module is where they meet.
"""

from __future__ import annotations

import importlib

from hpctrain.parallel.base import DPGroups
from hpctrain.parallel.plan import ParallelPlan

__all__ = ["parallelize", "Composed", "FLAVOUR_MODULES"]

FLAVOUR_MODULES = {"ddp": "hpctrain.parallel.ddp", "zero1": "hpctrain.parallel.zero",
                   "zero2": "hpctrain.parallel.zero", "zero3": "hpctrain.parallel.zero",
                   "fsdp": "hpctrain.parallel.fsdp"}
# The options key (config table) of each flavour.
_OPTION_KEYS = {"ddp": "ddp", "zero1": "zero", "zero2": "zero", "zero3": "zero", "fsdp": "fsdp"}


class Composed:
    """A data-parallel flavour's model (gradients, step, norms, checkpoint entries, memory)
    run by a model-parallel executor (forward/backward, which samples and which part of
    each sample this rank reads). Every other attribute is the flavour's."""

    def __init__(self, inner, executor, name: str):
        self._inner = inner
        self._executor = executor
        self.name = name

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def forward_backward(self, micro_batches, loss_fn, precision) -> float:
        """Run the executor over the step's micro-batches (collective)."""
        return self._executor.forward_backward(self._inner.model, micro_batches, loss_fn,
                                               precision, self._inner.backward)

    def data_shard(self, world) -> tuple[int, int]:
        return self._executor.data_shard(world)

    def load_batch(self, dataset, indices):
        return self._executor.load_batch(dataset, indices)


def _log(world, text: str) -> None:
    if world.is_main:
        print(f"hpctrain: {text}", flush=True)


def _ranks(comm) -> str:
    return f"groups of {comm.size} rank{'s' if comm.size != 1 else ''}"


def _flavour(plan: ParallelPlan, model, make_optimizer, world, options: dict, groups: DPGroups):
    module = importlib.import_module(FLAVOUR_MODULES[plan.flavour])
    opts = options.get(_OPTION_KEYS[plan.flavour])
    if hasattr(module, "options_for"):
        opts = module.options_for(plan.flavour, opts)
    return module.wrap(model, make_optimizer, world, opts, groups=groups)


def parallelize(plan: ParallelPlan, model, make_optimizer, world, options: dict | None = None,
                activation_checkpointing: bool = False):
    """Apply the plan's transforms to model (a LayerStack or nn.Sequential when the plan has
    a pipeline) and return the Parallelized (collective over the world).

    ``options``: typed options per config table ({"ddp": DDPOptions, "zero": ZeroOptions,
    "fsdp": FSDPOptions, "pipeline": PipelineOptions, "domain": DomainOptions}); missing
    ones take their defaults.
    """
    options = dict(options or {})
    if plan.world_size != world.size:
        raise ValueError(f"plan {plan.describe()} is for {plan.world_size} ranks, the world "
                         f"has {world.size}")
    _log(world, f"plan {plan.describe()}")
    if plan.name == "single":
        from hpctrain.parallel import single

        if activation_checkpointing:
            _checkpoint(model, world)
        return single.wrap(model, make_optimizer, world)
    if plan.pipeline:
        return _pipeline(plan, model, make_optimizer, world, options, activation_checkpointing)
    executor, groups = None, DPGroups.of_world(world)
    step = 1
    if plan.domain:
        from hpctrain.parallel.domain import strategy as domain

        mesh = world.mesh(plan.layout)
        model, executor = domain.prepare(model, world, mesh, options.get("domain"))
        groups = DPGroups(mesh.comm("dp"), executor.partial_groups, world.comm)
        _log(world, f"transform {step}: domain: spatial layers split over dom="
                    f"{'x'.join(map(str, plan.dom))} ({_ranks(mesh.comm('dom'))}); weight "
                    f"gradients are partial over dom")
        step += 1
    if activation_checkpointing:
        n = _checkpoint(model, world)
        _log(world, f"transform {step}: activation checkpointing: {n} blocks recompute "
                    f"their activations in backward")
        step += 1
    par = _flavour(plan, model, make_optimizer, world, options, groups)
    sums = " x ".join([f"dp ({groups.dp.size})"] + [f"partial ({c.size})" for c in groups.partial])
    _log(world, f"transform {step}: {plan.flavour} over dp={groups.dp.size}; gradients summed "
                f"over {sums} ranks")
    if executor is None:
        return par
    return Composed(par, executor, plan.name)


def _checkpoint(model, world) -> int:
    from hpctrain.parallel.activation_checkpointing import checkpoint_blocks

    return checkpoint_blocks(model, is_main=world.is_main)


def _pipeline(plan, stack, make_optimizer, world, options, activation_checkpointing):
    """The pipeline transform with its stages' dp flavour (its own, for now: ddp, zero1 or
    zero2 over the replicas of each stage)."""
    from dataclasses import replace

    from hpctrain.parallel.pipeline import PipelineOptions, wrap

    opts = options.get("pipeline") or PipelineOptions()
    opts = replace(opts, mesh=plan.layout, dp_sharding=plan.flavour,
                   activation_checkpointing=activation_checkpointing or opts.activation_checkpointing)
    par = wrap(stack, make_optimizer, world, opts)
    par.name = plan.name
    return par
