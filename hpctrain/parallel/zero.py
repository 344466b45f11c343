"""ZeRO stages 1, 2 and 3, hand-written over the Communicator (MPI ranks now, NCCL later).

Trainable parameters are flattened per unit (one unit per repeated block plus a root; see
``units.py``) into buffers padded to a multiple of the world size; rank r owns the r-th
slice, and the optimizer steps only those shard parameters.

- stage 1: full gradients on every rank, reduce-scattered (SUM) at the step; after the
  step the updated shards are all-gathered back into the full buffers.
- stage 2: as 1, but on the last micro-batch of a step each unit's gradients are
  reduce-scattered as soon as they are all accumulated, and the full ones freed.
- stage 3: as 2, and the full parameters exist only around a unit's forward and backward.

Gradients are SUMMED (the loop weights each micro-batch by its share of the global batch).
Collectives run in the same order on every rank as long as every rank's autograd graph has
the same structure (the same parameters used), which data parallel training gives.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hpctrain.parallel.base import OptimizerFactory, Parallelized
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.sharding.engine import ShardedModel, ShardPlan, broadcast_state
from hpctrain.parallel.sharding.schedule import GatherSchedule
from hpctrain.parallel.sync_batchnorm import convert_sync_batchnorm
from hpctrain.parallel.units import partition

__all__ = ["ZeroOptions", "wrap"]


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO stage (1: optimizer state, 2: + gradients, 3: + parameters sharded), micro-batches
    per step, and whether BatchNorm layers use global-batch statistics."""

    stage: int = 1
    grad_accum: int = 1
    sync_batchnorm: bool = True

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptions.stage = {self.stage!r}: expected 1, 2 or 3 "
                             "(strategies zero1, zero2, zero3)")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"ZeroOptions.grad_accum = {self.grad_accum!r}: expected an int >= 1 "
                             "(the number of backward calls per step)")


class Zero(ShardedModel):
    """A model sharded by ZeRO stage 1, 2 or 3 (the engine does the work)."""

    def __init__(self, model, make_optimizer, world, units, frozen, opts: ZeroOptions, schedule):
        self.opts = opts
        plan = ShardPlan(name=f"zero{opts.stage}", stage=opts.stage, grad_accum=opts.grad_accum,
                         persistent_grads=opts.stage == 1, on_demand=opts.stage == 3)
        super().__init__(model, make_optimizer, world, units, frozen, plan, schedule=schedule)


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world, options: ZeroOptions | None = None
         ) -> Parallelized:
    """Shard model and optimizer over all ranks with ZeRO (collective over the world)."""
    opts = options or ZeroOptions()
    model.to(world.device)
    if opts.sync_batchnorm:  # batch statistics of the global batch, as in one process
        model = convert_sync_batchnorm(model, world.comm)
    broadcast_state(model, world.comm)
    specs, frozen = partition(model)
    units = [FlatUnit(s.name, s.params, world.comm, keep_full=opts.stage < 3) for s in specs]
    schedule = GatherSchedule(specs, units) if opts.stage == 3 else None
    return Zero(model, make_optimizer, world, units, frozen, opts, schedule)
