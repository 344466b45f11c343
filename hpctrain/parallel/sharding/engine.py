"""The sharded model: the engine class tying its parts together, and the sharded step.

Shared by zero (stages 1-3) and fsdp; a strategy picks the knobs (``ShardPlan``):

- ``persistent_grads`` (zero1): full gradients live in one flat buffer per unit and are
  reduce-scattered at the step (a ring over the buffer as it lies: on 2 ranks x 2 cores this
  measured 15-25 ms per step cheaper than starting each unit in the hooks). Otherwise each
  unit's reduce-scatter STARTS (non-blocking, piece by piece: ``_start``) as soon as its
  gradients are all accumulated in the step's last backward, overlapping the rest of that
  backward, the full gradients are freed, and the step's synchronize (``_sync_grads``)
  completes it; see ``grad_sync``.
- ``on_demand`` units (zero3, FULL_SHARD, SHARD_GRAD_OP) exist in full only while a
  ``GatherSchedule`` needs them; the others keep their full buffer and are refreshed from
  the shards after each step.
- ``shard_comm`` shards the units; ``replicate_comm`` (HYBRID_SHARD, NO_SHARD) all-reduces
  the reduce-scattered gradient shards over the replicas of each shard. Everything else
  comes from the parameters' placements (placement.py), given by the model-parallel
  transforms: the groups whose ranks hold partial gradients of the same parameters (the
  domain tiles; the pipeline stages holding a tied weight, summed only at the step), how
  much each shard counts in the global norms, and the N-D slice of the global tensor each
  parameter is in the checkpoint.

Each part has its own module; ``ShardedModel`` holds the state they share and runs the step:

- ``unit_state``: per-unit bookkeeping (the step's gradient flags, partial groups, norm weights);
- ``grad_sync``: gradient reduction in one fixed unit order, overlapped with backward;
- ``agreement``: what the ranks agree on at the step (who got gradients, late units);
- ``norms``: global norms, clipping and the non-finite path;
- ``state``: checkpoint entries (flat shards as element ranges of the global tensors);
- ``memory``: the memory report; ``freed``: state_dict() refused while units are freed;
- ``prepare``: what zero and fsdp do to the model before flattening it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from hpctrain.parallel.base import Parallelized
from hpctrain.parallel.deferred import materialize
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.placement import Copies, Placement, placement_of
from hpctrain.parallel.sharded_optim import preserve_elements
from hpctrain.parallel.sharding.agreement import Agreement
from hpctrain.parallel.sharding.freed import guard_freed_params
from hpctrain.parallel.sharding.grad_sync import GradSync
from hpctrain.parallel.sharding.memory import ShardMemory
from hpctrain.parallel.sharding.norms import ShardNorms
from hpctrain.parallel.sharding.prepare import broadcast_state, prepare_model
from hpctrain.parallel.sharding.reduction import InFlight
from hpctrain.parallel.sharding.state import ShardState, read_shard_state
from hpctrain.parallel.sharding.unit_state import UnitState, common_partial
from hpctrain.parallel.storage import nbytes

__all__ = ["ShardPlan", "ShardedModel", "broadcast_state", "nbytes", "read_shard_state",
           "prepare_model"]

@dataclass(frozen=True)
class ShardPlan:
    """How a ShardedModel treats its units (see the module docstring)."""

    name: str
    stage: int                        # the ZeRO stage it corresponds to (memory report)
    grad_accum: int = 1
    persistent_grads: bool = False
    on_demand: bool = False
    reduce_dtype: torch.dtype | None = None
    # False: an executor (the pipeline's) says when units are gathered, freed and reduced
    # (gather_units / free_units / reduce_units); the gradient hooks only record arrivals.
    hook_reduce: bool = True
    # Bytes of reduce-scatter piece buffers alive at once (in flight or kept for reuse):
    # the options' reduce_bucket_size; None: reduction.DEFAULT_BUCKET_BYTES.
    reduce_bucket_size: int | None = None


class ShardedModel(GradSync, Agreement, ShardNorms, ShardState, ShardMemory, Parallelized):
    """A model whose trainable parameters, gradients and optimizer state are sharded."""

    reshard_after_forward = True  # an executor frees on-demand units after their forward

    def __init__(self, model, make_optimizer, world, units, frozen, plan: ShardPlan,
                 shard_comm=None, replicate_comm=None, schedule=None, name_of=None):
        self.name = plan.name
        self.plan = plan
        self.world = world
        self.comm = shard_comm if shard_comm is not None else world.comm
        self.replicate = replicate_comm if replicate_comm is not None and replicate_comm.size > 1 \
            else None
        self.name_of = name_of or (lambda name: name)  # local name -> checkpoint name
        self.units = units
        self.frozen = frozen
        self.schedule = schedule
        self._replicas = (Copies("replicate", self.replicate),) if self.replicate else ()
        self._slot_ids = {id(s.param) for u in units for s in u.slots}
        copies = [[placement_of(s.param).copies for s in u.slots] for u in units]
        # Partial groups summed with each unit's reduction: those of every parameter.
        common = common_partial(units, copies)
        self.partial = [c.comm for c in common]
        self._states = [UnitState(u, c, self._replicas, common) for u, c in zip(units, copies)]
        self._micro = 0
        self._final = True
        # The one order in which every rank reduces units: backward's usual order (the last
        # block's first, the root unit, holding embeddings, last; a model without one, all
        # blocks, has no root unit). A hook reduces a complete unit only when every unit
        # before it in this order is reduced, and the step reduces the rest in the same
        # order, so ranks whose graphs differ (a branch taken on some ranks only) still issue
        # the same collectives in the same order: no deadlock, no mismatch. (Putting a block
        # last would keep its gradients alive through the whole backward.)
        n = len(units)
        roots = [i for i, u in enumerate(units) if u.name == "<root>"]
        self._order = [i for i in range(n - 1, -1, -1) if i not in roots] + roots
        # A GatherSchedule's stream closes (reduces) the units in its own canonical order.
        self._streamed = schedule is not None and plan.hook_reduce and not plan.persistent_grads
        if self._streamed:
            self._order = schedule.close_order()
            schedule.on_close = self._close
        self._agreed = None  # the step's agreed flags (_agree_flags), for _untouched
        self._next = 0  # position in _order of the next unit to reduce in this backward
        self._reductions = InFlight(plan.reduce_dtype, plan.reduce_bucket_size)
        self._step_buffers = 0  # persistent grads: the step's reduce-scatter transient
        self._peak_unit_grads = 0  # most full-gradient bytes alive when a reduction starts
        self._grad_bytes = 0
        self._copies_checked = False
        super().__init__(model, make_optimizer([u.shard for u in units]), world.host)
        for i, st in enumerate(self._states):
            u = st.unit
            if plan.persistent_grads:
                # Autograd accumulates in place into preset .grad views of one flat buffer.
                st.grad_buf = torch.zeros_like(u.full)
                u.point_grads(st.grad_buf)
            for j, s in enumerate(u.slots):
                s.param.register_post_accumulate_grad_hook(partial(self._on_grad, i, j))
        if plan.on_demand:
            guard_freed_params(model, units)
        materialize(model)  # what deferred init left: frozen parameters, buffers

    def _placement(self, t: torch.Tensor) -> Placement:
        """Where t lives: a sharded parameter is flat-sharded over the shard group (its
        elements there are distinct) and held alike by the replicas; anything else (buffers,
        frozen parameters) every rank of the shard group holds whole too."""
        if id(t) in self._slot_ids:
            return placement_of(t).with_copies(*self._replicas)
        return placement_of(t).with_copies(Copies("dp", self.comm), *self._replicas)

    def _refresh(self, u: FlatUnit) -> None:
        """Make a unit that keeps its full buffer see the stepped shard."""
        if u.keep_full:
            if self.comm.size > 1:
                u.gather()  # params are views of the full buffer: the model sees the step
        else:  # a full buffer of another dtype/device: re-fill it (the same storage)
            u.free()
            u.gather()

    def step(self, scaler=None, max_grad_norm: float = 0.0, guard=None) -> bool:
        """Reduce-scatter gradients, unscale/clip over shards, step the shards, re-gather
        (collective). ``guard``: as Parallelized.step; returns whether the shards stepped."""
        self._sync_grads()
        untouched, idle_shards = self._untouched()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            self._agree_on_inf(scaler)
        norm = self._clip(max_grad_norm) if max_grad_norm > 0 else None
        stepped = guard is None or guard.check(self, scaler, norm)
        # A unit no rank used this step is skipped by the optimizer, as one process skips a
        # parameter without .grad: no weight decay, no new state, Adam's step count kept.
        for shard in idle_shards:
            shard.grad = None
        if stepped:
            with preserve_elements(self.optimizer, untouched):
                self._optimizer_step(scaler)
        elif scaler is not None:
            scaler.update()  # the step is dropped; the scaler is ready for the next one
        # Measured, not assumed: every gradient tensor alive at the step.
        self._grad_bytes = nbytes([u.shard.grad for u in self.units if u.shard.grad is not None]
                                  + [st.grad_buf for st in self._states if st.grad_buf is not None]
                                  + [s.param.grad for u in self.units for s in u.slots
                                     if s.param.grad is not None])
        for st in self._states:
            if self.plan.persistent_grads:
                st.grad_buf.zero_()
            else:
                st.unit.shard.grad = None
            st.had = [False] * len(st.unit.slots)
            if not self.plan.on_demand:
                self._refresh(st.unit)
        self._micro = 0
        return stepped
