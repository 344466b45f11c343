"""ZeRO stages 1, 2 and 3, hand-written over the Communicator (MPI ranks now, NCCL later).

Trainable parameters are flattened per unit (by default one per block plus a root; the
auto-wrap policies of ``units.py``, as fsdp) into buffers padded to a multiple of the world
size; rank r owns the r-th slice, and the optimizer steps only those shard parameters.

- stage 1: full gradients on every rank, reduce-scattered (SUM) at the step; after the
  step the updated shards are all-gathered back into the full buffers.
- stage 2: as 1, but on the last micro-batch of a step each unit's gradients are
  reduce-scattered as soon as they are all accumulated, and the full ones freed.
- stage 3: as 2, and the full parameters exist only around a unit's forward and backward.

Gradients are SUMMED (the loop weights each micro-batch by its share of the global batch).
Gradient reductions run in one fixed unit order on every rank, whatever parameters each
rank's graph used; zero3's gathers follow the modules that run, so under stage 3 every rank
must run the same modules.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from hpctrain.parallel.base import DPGroups, OptimizerFactory, Parallelized
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.sharding.engine import ShardedModel, ShardPlan, prepare_model
from hpctrain.parallel.sharding.schedule import GatherSchedule
from hpctrain.parallel.zero_options import ZeroOptions

__all__ = ["ZeroOptions", "options_for", "wrap"]


def options_for(strategy: str, options: ZeroOptions | None) -> ZeroOptions:
    """The options of strategy 'zero1', 'zero2' or 'zero3': the name's stage filled in;
    ValueError when the options name another stage."""
    stage = int(strategy[-1])
    if options is None:
        return ZeroOptions(stage=stage)
    if not isinstance(options, ZeroOptions):
        raise TypeError(f"strategy {strategy!r} takes ZeroOptions, got "
                        f"{type(options).__name__}")
    if options.stage is None:
        return replace(options, stage=stage)
    if options.stage != stage:
        raise ValueError(f"strategy {strategy!r} with ZeroOptions(stage={options.stage}): the "
                         f"name and the options ask for different stages; pass "
                         f"ZeroOptions(stage={stage}) (or no stage) or strategy "
                         f"'zero{options.stage}'")
    return options


class Zero(ShardedModel):
    """A model sharded by ZeRO stage 1, 2 or 3 (the engine does the work)."""

    def __init__(self, model, make_optimizer, world, units, frozen, opts: ZeroOptions, schedule,
                 groups: DPGroups, specs=None, external: bool = False, name_of=None):
        self.opts = opts
        plan = ShardPlan(name=f"zero{opts.stage}", stage=opts.stage, grad_accum=opts.grad_accum,
                         persistent_grads=opts.stage == 1, on_demand=opts.stage == 3,
                         hook_reduce=not external, reduce_bucket_size=opts.reduce_bucket_size)
        super().__init__(model, make_optimizer, world, units, frozen, plan, shard_comm=groups.dp,
                         schedule=schedule, name_of=name_of)


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world, options: ZeroOptions | None = None,
         groups: DPGroups | None = None, units=None, name_of=None) -> Parallelized:
    """Shard model and optimizer over the dp replicas with ZeRO (``groups``: from the
    orchestrator; default every rank a replica). Collective over the world.

    ``units`` (UnitSpecs from a model-parallel transform, e.g. the pipeline's) replace the
    auto-wrap policy; that transform's executor then gathers, frees and reduces them
    (``gather_units``...). ``name_of`` maps local parameter names to checkpoint names."""
    if options is None or options.stage is None:
        raise ValueError(f"zero.wrap needs the stage: got {options!r}; pass ZeroOptions(stage=1, "
                         "2 or 3), or use parallel.wrap('zero2', ...) (hpctrain.parallelize), "
                         "which takes it from the name")
    opts = options
    groups = groups or DPGroups.of_world(world)
    external = units is not None
    model, specs, frozen = prepare_model(model, world, opts, groups, units)
    flat = [FlatUnit(s.name, s.params, groups.dp, keep_full=opts.stage < 3) for s in specs]
    schedule = GatherSchedule(specs, flat, root=model) if opts.stage == 3 and not external \
        else None
    if opts.stage == 3 and external:
        for u in flat:  # the executor gathers each unit when its layers run
            u.free()
    return Zero(model, make_optimizer, world, flat, frozen, opts, schedule, groups, specs,
                external, name_of)
