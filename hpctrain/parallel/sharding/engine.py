"""The sharded model: gradient reduction, sharded step, norms, checkpoints, memory report.

Shared by zero (stages 1-3) and fsdp; a strategy picks the knobs (``ShardPlan``):

- ``persistent_grads`` (zero1): full gradients live in one flat buffer per unit and are
  reduce-scattered at the step (a ring over the buffer as it lies: on 2 ranks x 2 cores this
  measured 15-25 ms per step cheaper than starting each unit in the hooks). Otherwise each
  unit's reduce-scatter STARTS (non-blocking, piece by piece: ``_start``) as soon as its
  gradients are all accumulated in the step's last backward, overlapping the rest of that
  backward, the full gradients are freed, and the step's synchronize (``_sync_grads``)
  completes it; see "Overlapped reduction" below.
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

Gradients are SUMMED (the loop weights each micro-batch by its share of the global batch).
Gradient reductions run in one fixed unit order on every rank, whatever parameters each
rank's graph used, so a branch taken on some ranks only (data-dependent unused parameters)
neither deadlocks nor pairs mismatched collectives. On-demand units driven by the
``GatherSchedule`` (zero3, fsdp FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD) interleave their
gathers with those reductions in one canonical stream that every rank walks in full, forward
and backward (see ``schedule``): a unit is reduced at its CLOSE in that stream; gradients that
arrive after it (a unit whose backward runs out of the canonical order) are reduced again at
the step on every rank, the ranks agreeing on which in the one flag all-reduce the step does
anyway (parameters that got no gradient anywhere).

Overlapped reduction (Horovod's pattern: start in the hooks, complete in synchronize): a
backward hook starts the ready units' reductions, in the fixed order, as non-blocking pieces
(``reduction.InFlight``, piece buffers capped by ``reduce_bucket_size``; memory_report's
``reduce_buffers`` is their peak, ``reduce_buffers_limit`` the cap's), and tests the
oldest request (Open MPI moves data only inside MPI calls).
``_sync_grads`` starts what the hooks did not (units with a parameter whose hook never
fired, in the same order) and completes all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from hpctrain.parallel.base import Parallelized
from hpctrain.parallel.deferred import is_placeholder, materialize, to_device
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.placement import Copies, Placement, entry, global_norm, placement_of
from hpctrain.parallel.sharded_optim import preserve_elements
from hpctrain.parallel.sharding.reduction import InFlight, reduction_buffer_bytes
from hpctrain.runtime.malloc import release_free_heap

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


class _UnitState:
    """Per-step bookkeeping of one unit's gradients, and where its parameters live."""

    def __init__(self, unit: FlatUnit, copies: list, replicas: tuple, common: tuple = ()):
        self.unit = unit
        # Partial groups summed at the step, after the unit's reduction: (comm, slots: None
        # for the whole unit). Those summed only at the step (ranks running different
        # pipeline stages hold a tied weight), and those only some of the unit's parameters
        # are partial over (under sequence parallel a LayerNorm ran on sequence chunks, the
        # tensor-parallel weights beside it did not).
        self.partial = _step_partials(unit, copies, common)
        # Each parameter's share in global norms (a tensor-parallel bias held alike by the
        # tp ranks counts once over them; the flat shards over the shard group are distinct).
        self.weights = [Placement((), copies=c + replicas).norm_weight for c in copies]
        self.had = [False] * len(unit.slots)   # got a gradient this step (this rank)
        self.arrived: set = set()              # slots whose grad arrived this micro-batch
        self.reduced = False                   # its reduction started in a final backward
        self.late = False                      # gradients arrived after its close (schedule)
        self.grad_buf = None                   # persistent_grads: the flat gradient buffer

    def terms(self, flat: torch.Tensor) -> list:
        """(part of ``flat``, norm weight) pairs for a shard-shaped tensor (norms)."""
        if len(set(self.weights)) <= 1:
            return [(flat, self.weights[0] if self.weights else 1.0)]
        return [(flat[a:b], w) for s, w in zip(self.unit.slots, self.weights)
                for a, b in self.unit.owned_ranges([s])]


class ShardedModel(Parallelized):
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
        common = _common_partial(units, copies)
        self.partial = [c.comm for c in common]
        self._states = [_UnitState(u, c, self._replicas, common) for u, c in zip(units, copies)]
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
            _guard_freed_params(model, units)
        materialize(model)  # what deferred init left: frozen parameters, buffers

    # ---- backward ----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss; on a step's last micro-batch start reducing them per
        unit (collective; completed by step())."""
        self._final = self._micro + 1 >= self.plan.grad_accum
        self._next = 0
        for st in self._states:
            st.arrived = set()
            if self._streamed and self._final:
                # The stream closes every unit in each backward, on every rank: a second
                # final backward before the step (its gradients are new) reduces again.
                st.reduced = False
        if self.schedule is not None:
            self.schedule.begin_backward()
        loss.backward()
        if self.schedule is not None:
            self.schedule.finish_backward()  # the rest of the stream: same on every rank
        self._micro += 1

    def _on_grad(self, i: int, j: int, param: nn.Parameter) -> None:
        st = self._states[i]
        st.had[j] = True
        self._reductions.progress()
        if self.plan.persistent_grads or not self.plan.hook_reduce:
            return
        st.arrived.add(j)
        if self._streamed:
            if i in self.schedule.closed:
                st.late = st.late or self._final  # reduced again at the step (_sync_grads)
            elif len(st.arrived) == len(st.unit.slots):
                self.schedule.complete(i)  # closes it (frees, reduces) when the stream may
            return
        if len(st.arrived) == len(st.unit.slots):
            # Its backward is over (every use of its params is done): free the gathered
            # params BEFORE its gradients are reduced, so the two never coexist longer.
            if self.plan.on_demand:
                st.unit.free()
            if self._final:  # non-final micro-batches accumulate locally: no communication
                self._reduce_ready()
            release_free_heap()  # the activations freed so far: before the next unit's peak

    def _close(self, i: int) -> None:
        """The schedule closed unit i (freed it): in the step's last backward, reduce what
        arrived (collective; its place in the stream is the same on every rank)."""
        st = self._states[i]
        if self._final and not st.reduced:
            self._start(st)
            release_free_heap()

    def _reduce_ready(self) -> None:
        """Start reducing, in the fixed order, every unit that is complete and whose
        predecessors are started (collective; the same sequence on every rank, see
        ``_order``)."""
        while self._next < len(self._order):
            st = self._states[self._order[self._next]]
            if len(st.arrived) != len(st.unit.slots):
                return
            self._start(st)
            self._next += 1

    # ---- control by an executor (plan.hook_reduce False: the pipeline's schedule) ----------

    def set_final(self, final: bool) -> None:
        """Whether the coming backwards are the step's last (only those reduce)."""
        self._final = final

    def gather_units(self, indices) -> None:
        """Gather the on-demand units ``indices`` (collective over the shard group)."""
        if self.plan.on_demand:
            for i in indices:
                self.units[i].gather()

    def free_units(self, indices) -> None:
        """Free the full buffers of the on-demand units ``indices``."""
        if self.plan.on_demand:
            for i in indices:
                self.units[i].free()

    def reduce_units(self, indices) -> None:
        """In the step's last backwards: start reducing units whose gradients are complete
        now (collective over the shard group and the unit's partial groups; completed by
        step())."""
        self._reductions.progress()
        if not self._final or self.plan.persistent_grads:
            return
        for i in indices:
            st = self._states[i]
            if not st.reduced:
                self.free_units([i])
                self._start(st)
        release_free_heap()

    def _start(self, st: _UnitState) -> None:
        """Start reducing the unit's gradients (SUM) into its shard gradient over the shard
        group, then the replicas and partial groups (collective; completed at the step)."""
        stages = ([self.replicate] if self.replicate is not None else []) + self.partial
        st.reduced = True
        # Measured: the full gradients alive now (this unit's, and any that wait for their
        # unit to complete, as a root unit's head gradient does until the embedding's).
        self._peak_unit_grads = max(self._peak_unit_grads, nbytes(
            [s.param.grad for o in self._states for s in o.unit.slots
             if s.param.grad is not None]))
        self._reductions.start(st.unit, self.comm, stages)

    def _sync_grads(self) -> None:
        # Persistent gradients: reduce-scatter every buffer now. Otherwise start what the
        # hooks did not, in the same fixed order: units with a parameter that got no gradient
        # in the last backward (or leftovers of earlier micro-batches), every unit when the
        # hooks do not reduce, and under a schedule units with late gradients on any rank,
        # again. Whether a hook started a unit is the same on every rank: it was a
        # collective. Then complete everything, in start order.
        late = self._agree_flags() if self._streamed else [False] * len(self._states)
        for st, again in ((self._states[i], late[i]) for i in self._order):
            u = st.unit
            if self.plan.persistent_grads:
                if self.comm.size > 1:  # the result and the ring's two chunks: 3 shards
                    self._step_buffers = max(self._step_buffers, 3 * u.shard_numel *
                                             st.grad_buf.element_size())
                u.reduce_grad_buffer(st.grad_buf, self.comm)
                for c in ([self.replicate] if self.replicate is not None else []) + \
                        self.partial:
                    c.allreduce(u.shard.grad, op="sum")  # a view of grad_buf: in place
            elif not st.reduced or again:
                self._start(st)
        self._reductions.finish_all()
        for st in (self._states[i] for i in self._order):
            u = st.unit
            st.reduced = st.late = False
            if self.plan.on_demand:
                u.free()
            if u.shard.grad is None:
                u.shard.grad = torch.zeros_like(u.shard)
        # A unit's own partial groups (a weight tied across pipeline stages; a LayerNorm
        # run on sequence chunks) only now, after every stage's schedule: mid-schedule the
        # stages are at different actions.
        for st in self._states:
            for c, slots in st.partial:
                grad = st.unit.shard.grad
                if slots is None:
                    c.allreduce(grad, op="sum")
                    continue
                ranges = st.unit.owned_ranges(slots)
                if ranges:  # the same ranges on every rank of c: the same unit layout
                    buf = c.allreduce(torch.cat([grad[a:b] for a, b in ranges]), op="sum")
                    k = 0
                    for a, b in ranges:
                        grad[a:b].copy_(buf[k:k + b - a])
                        k += b - a
        if not self._copies_checked:
            self._copies_checked = True
            self._check_same_copies()

    def _check_same_copies(self) -> None:
        """Once, at the first step: the gradients of copies placed as 'already the same'
        (not summed: a tensor-parallel LayerNorm run on whole activations) must be equal on
        the ranks holding them. A module that in fact ran on sequence chunks (a user plan
        that leaves a LayerNorm out of the sequence_parallel style) would otherwise train
        each copy on its chunk alone, silently (collective over those groups)."""
        stats: dict = {}
        for st in self._states:
            grad = st.unit.shard.grad
            for slot in st.unit.slots:
                same = [c for c in placement_of(slot.param).copies
                        if not c.partial and c.size > 1]
                if not same:
                    continue
                part = torch.cat([grad[a:b] for a, b in st.unit.owned_ranges([slot])]
                                 or [grad[:0]]).double()
                for c in same:
                    stats.setdefault(c, []).append((slot.name, float(part.sum()),
                                                    float(part.abs().sum())))
        for c, rows in stats.items():
            v = torch.tensor([[s, -s] for _, s, _ in rows], dtype=torch.float64,
                             device=self.comm.device)
            c.comm.allreduce(v, op="max")
            for (name, _, scale), (hi, neg_lo) in zip(rows, v.tolist()):
                if hi + neg_lo > 1e-6 * scale + 1e-30:
                    raise RuntimeError(
                        f"{self.name}: the gradient of {self.name_of(name)!r} differs between "
                        f"the {c.size} ranks of group {c.name!r} that hold it as the same copy "
                        f"(sums {hi:.6g} vs {-neg_lo:.6g}), so it did not see the same "
                        f"activations there. Under sequence parallel give its module the "
                        f"'sequence_parallel' style (it ran on sequence chunks)")

    # ---- the step ----------------------------------------------------------------------

    def _agree_flags(self) -> list[bool]:
        """One all-reduce (MAX) over every rank holding the same units (shards, replicas,
        partials) of the step's per-parameter 'got a gradient' flags, kept for _untouched,
        each unit's 'late gradients' flag and the schedule's count of out-of-stream gathers;
        returns the late flags. Raises if the ranks' out-of-stream gathers differ."""
        n = sum(len(st.had) for st in self._states)
        ooo = self.schedule.ooo_gathers % 256 if self.schedule is not None else 0
        flags = torch.tensor([h for st in self._states for h in st.had] +
                             [st.late for st in self._states] + [ooo, 255 - ooo],
                             dtype=torch.uint8, device=self.comm.device)
        for c in [self.comm, self.replicate, *self.partial]:
            if c is not None and c.size > 1:
                c.allreduce(flags, op="max")
        if self.schedule is not None:
            self.schedule.ooo_gathers = 0
        got = flags.tolist()
        self._agreed = flags[:n].clone()
        if got[-2] + got[-1] != 255:  # not every rank had the same count
            raise RuntimeError(
                f"{self.name}: the ranks gathered sharded units out of the canonical order a "
                "different number of times in this step, so their all-gathers were paired "
                "mismatched: a unit ran again after the gather stream had passed it (used "
                "twice, or a module run out of registration order) on some ranks only. Make "
                "such reuse the same on every rank, or register modules in the order they "
                "run (see hpctrain.parallel.sharding.schedule)")
        return [bool(f) for f in got[n:n + len(self._states)]]

    def _untouched(self) -> tuple[dict, list]:
        """({shard: shard-local ranges} of parameters that got no gradient on ANY rank, the
        shards of units none of whose parameters got one)."""
        if self._agreed is not None:  # agreed by _sync_grads in this step
            had, self._agreed = self._agreed, None
        else:
            had = torch.tensor([h for st in self._states for h in st.had], dtype=torch.uint8,
                               device=self.comm.device)
            for c in [self.comm, self.replicate, *self.partial]:
                if len(had) and c is not None and c.size > 1:
                    c.allreduce(had, op="max")
        if len(had):  # over every rank holding the same units: shards, replicas, partials
            k = 0
            for st in self._states:  # a tied copy: also over the stages holding one
                n = len(st.had)
                for c, _ in st.partial:
                    sub = had[k:k + n].clone()
                    c.allreduce(sub, op="max")
                    had[k:k + n] = sub
                k += n
        flags, out, whole, k = had.tolist(), {}, [], 0
        for st in self._states:
            n = len(st.unit.slots)
            idle = [s for s, f in zip(st.unit.slots, flags[k:k + n]) if not f]
            if len(idle) == n:
                whole.append(st.unit.shard)
            else:
                out[st.unit.shard] = st.unit.owned_ranges(idle)
            k += n
        return out, whole

    def _agree_on_inf(self, scaler) -> None:
        # Each rank unscaled only its shard; an inf in another rank's shard must skip the
        # step here too. (GradScaler keeps found_inf per optimizer in this private table.)
        found = scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        for t in found.values():
            if t.device == self.world.comm.device:
                self.world.comm.allreduce(t, op="max")
            else:  # offloaded shards are unscaled on the host
                self.world.host.allreduce(t, op="max")

    def _grad_norm(self) -> float:
        # Each shard's squares weighted by its placement, summed over the job: every element
        # counts once, over shards, replicas, domain tiles, stages and tied copies alike.
        return global_norm([t for st in self._states if st.unit.shard.grad is not None
                            for t in st.terms(st.unit.shard.grad)], self.job_comm)

    def _placement(self, t: torch.Tensor) -> Placement:
        """Where t lives: a sharded parameter is flat-sharded over the shard group (its
        elements there are distinct) and held alike by the replicas; anything else (buffers,
        frozen parameters) every rank of the shard group holds whole too."""
        if id(t) in self._slot_ids:
            return placement_of(t).with_copies(*self._replicas)
        return placement_of(t).with_copies(Copies("dp", self.comm), *self._replicas)

    def buffer_norm(self) -> float:
        """Global L2 norm of the floating buffers; collective."""
        with torch.no_grad():
            return global_norm([(b, self._placement(b).norm_weight) for b in self.model.buffers()
                                if b.is_floating_point()], self.job_comm)

    def _clip(self, max_norm: float) -> float:
        norm = self._grad_norm()
        if math.isfinite(norm) and norm > max_norm:
            for u in self.units:
                if u.shard.grad is not None:
                    u.shard.grad.mul_(max_norm / (norm + 1e-6))
        return norm

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

    def _nonfinite_grads(self) -> tuple[list, list]:
        """As Parallelized's, from the gradient shards: a parameter is named when an element
        of it that this rank owns is not finite."""
        names, bad = [], []
        for st in self._states:
            g, u = st.unit.shard.grad, st.unit
            finite = g is None or bool(torch.isfinite(g).all())
            for s in u.slots:
                names.append(s.name)
                if not finite and any(not bool(torch.isfinite(g[a:b]).all())
                                      for a, b in u.owned_ranges([s])):
                    bad.append(s.name)
        return names, bad

    # ---- checkpoints: sharded tensors as flat element ranges of the GLOBAL tensors -----

    def _slot_of(self) -> dict:
        return {id(s.param): (u, s) for u in self.units for s in u.slots}

    def state_entries(self) -> list:
        """Checkpoint entries named as base.py names them, placed by placement.entry: shards
        give their owned elements of the parameter's slice of the global tensor."""
        slot_of, entries, seen = self._slot_of(), [], set()
        job = self.world.size
        for key, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            name = f"model/{self.name_of(key)}"
            if id(t) in slot_of:
                u, s = slot_of[id(t)]
                elems, view = u.shard_view(s)
                entries.append(entry(name, view, self._placement(s.param), elems, job, s.shape))
            else:
                entries.append(entry(name, t.detach(), self._placement(t), None, job))
        for st in self._states:
            u = st.unit
            state = self.optimizer.state.get(u.shard, {})
            for s in u.slots:
                (a, b), _ = u.shard_view(s)
                start = s.offset + a - u.lo
                placed = self._placement(s.param)
                for k, v in sorted(state.items()):
                    if not torch.is_tensor(v):
                        continue
                    name = f"optim/{self.name_of(s.name)}/{k}"
                    if v.shape == u.shard.shape:
                        entries.append(entry(name, v.detach()[start:start + (b - a)], placed,
                                             (a, b), job, s.shape))
                    else:  # a per-shard scalar such as Adam's step: the same on every rank
                        scalar = placement_of(s.param).scalar(tuple(v.shape)).with_copies(
                            Copies("dp", self.comm), *self._replicas)
                        entries.append(entry(name, v.detach(), scalar, None, job))
        return entries

    def state_meta(self) -> dict:
        """As base.py, with the parameter names behind the flat shards in the groups."""
        meta = super().state_meta()
        names = [s.name for u in self.units for s in u.slots]
        for g in meta["optim_param_groups"]:
            g["params"] = names
        return meta

    def load_state_entries(self, reader) -> None:
        """Load this rank's shards and replicated tensors from a checkpoint of any strategy."""
        from hpctrain.checkpoint.layout import from_numpy

        slot_of, seen = self._slot_of(), set()
        with torch.no_grad():
            for key, t in self.model.state_dict(keep_vars=True).items():
                if id(t) in seen:
                    continue
                seen.add(id(t))
                name = f"model/{self.name_of(key)}"
                if id(t) in slot_of:
                    u, s = slot_of[id(t)]
                    elems, view = u.shard_view(s)
                    placed = placement_of(s.param)
                    a = reader.read(name, placed.global_shape, elems=elems,
                                    box=placed.box(s.shape))
                    if a is not None and view.numel():
                        view.copy_(from_numpy(a, view.dtype).reshape(view.shape))
                else:
                    placed = placement_of(t)
                    a = reader.read(name, placed.global_shape, box=placed.box(tuple(t.shape)))
                    if a is not None:
                        t.detach().copy_(from_numpy(a, t.dtype).reshape(t.shape))
            for u in self.units:
                if not self.plan.on_demand:
                    self._refresh(u)
        if not self._optim_class_matches(reader):
            return
        for u in self.units:
            state = read_shard_state(reader, u, self.name_of)
            if state:
                self.optimizer.state[u.shard] = state
        self._load_param_groups(reader)

    def _gathered(self) -> dict:
        """Each unit's shards all-gathered (collective over the shard group): the masters'
        values, not low-precision compute copies, and never the freed full buffers."""
        gathered = {}
        for u in self.units:
            full = self.comm.allgather(u.shard.detach().to(self.comm.device)).cpu()
            for s in u.slots:
                gathered[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
        return gathered

    # ---- norms and memory --------------------------------------------------------------

    def param_norm(self) -> float:
        """Global L2 norm of all parameters (each element once); collective."""
        with torch.no_grad():
            return global_norm([t for st in self._states for t in st.terms(st.unit.shard)] +
                               [(p, self._placement(p).norm_weight) for _, p in self.frozen],
                               self.job_comm)

    def memory_report(self) -> dict:
        """Bytes this rank holds for trainable params and optimizer state, the gradients alive
        at the last step, the largest transient buffers and the frozen (replicated) params;
        local. Transients, each measured and beside it the budget its option sets: the
        gathered units (``peak_gathered``; ``largest_gathered_unit`` + ``prefetch_buffer``, the
        largest unit ``allgather_bucket_size`` lets backward prefetch), and the overlapped
        reduction's buffers (``reduce_buffers``: the piece buffers alive at once plus what the
        backend stages to receive the pieces in flight; ``reduce_buffers_limit`` for the
        ``reduce_bucket_size``; zero1 reduce-scatters each unit's persistent gradient buffer
        whole at the step instead: the result and the MPI ring's two chunks, three shards of
        the largest unit, whatever the bucket). Beside them, where gradients are reduced
        during backward: ``unit_grads``, the most full-gradient bytes alive when a unit's
        reduction starts (its own, autograd's output, until the reduction frees them), and
        ``unit_grads_limit``, the largest unit's (plus the root unit's, which wait for the
        embedding's; every unit's under gradient accumulation, kept from the first
        micro-batch to the last one's reduction)."""
        on_demand = self.plan.on_demand
        params = nbytes([u.full for u in self.units if not on_demand] +
                        [u.shard for u in self.units])
        optim = nbytes([v for st in self.optimizer.state.values() for v in st.values()
                        if torch.is_tensor(v)])
        gathered = max(u.full_bytes() for u in self.units) if on_demand else 0
        red, n = self._reductions, self.comm.size
        overlapped = not self.plan.persistent_grads and n > 1
        staged = red.peak_inflight * (n - 1) // n
        if overlapped:
            limit = reduction_buffer_bytes(red.bucket, n)
        elif self.plan.persistent_grads and n > 1:
            limit = max(3 * u.shard_numel * u.full.element_size() for u in self.units)
        else:
            limit = 0
        return {"stage": self.plan.stage, "strategy": self.name, "world_size": self.world.size,
                "shard_group": self.comm.size,
                "replicas": self.replicate.size if self.replicate is not None else 1,
                "partial_groups": [c.size for c in self.partial] +
                                  sorted({c.size for st in self._states for c, _ in st.partial}),
                "trainable_numel": sum(u.numel for u in self.units),
                "padded_numel": sum(u.padded for u in self.units),
                "params": params, "grads": self._grad_bytes, "optimizer": optim,
                "largest_gathered_unit": gathered,
                "peak_gathered": self.schedule.peak_gathered if self.schedule else 0,
                "prefetch_buffer": self.schedule.prefetch_buffer if self.schedule else 0,
                "peak_prefetched": self.schedule.peak_prefetched if self.schedule else 0,
                "allgather_bucket_size": self.schedule.prefetch_bytes
                                         if self.schedule and self.schedule.prefetch else 0,
                "transient_grad_bucket": red.peak_bytes,
                "reduce_bucket_size": red.bucket if overlapped else 0,
                "reduce_buffers": red.peak_bytes + staged + self._step_buffers,
                "reduce_buffers_limit": limit,
                "unit_grads": self._peak_unit_grads,
                "unit_grads_limit": self._unit_grads_limit(),
                "frozen_params": nbytes([p for _, p in self.frozen])}


    def _unit_grads_limit(self) -> int:
        """Full-gradient bytes alive at once where gradients are reduced during backward:
        the largest unit's, plus the root unit's (the model's own parameters, embeddings
        and a tied head: complete, so reduced, only when backward reaches the embedding);
        under gradient accumulation every unit's (the earlier micro-batches accumulate
        full gradients locally)."""
        if self.plan.persistent_grads:
            return 0
        size = {id(u): u.numel * u.full.element_size() for u in self.units}
        if self.plan.grad_accum > 1:
            return sum(size.values())
        root = sum(size[id(u)] for u in self.units if u.name == "<root>")
        return root + max((size[id(u)] for u in self.units if u.name != "<root>"), default=0)


def _step_partials(u: FlatUnit, copies: list, common: tuple) -> list:
    """[(comm, slots)] a unit's gradients are summed over at the step: the groups some of
    its parameters are partial over beyond ``common`` (summed with the reduction), with the
    slots that are (None: all of them), in the order first met (the same on every rank)."""
    found: dict = {}
    for slot, cs in zip(u.slots, copies):
        for c in cs:
            if c.partial and (c.at_step or c not in common):
                found.setdefault(c, (c.comm, []))[1].append(slot)
    return [(comm, None if len(slots) == len(u.slots) else slots)
            for comm, slots in found.values()]


def _common_partial(units: list, copies: list) -> tuple:
    """The partial groups (not only at the step) that EVERY parameter of every unit is
    partial over (a domain split's tiles): summed with each unit's reduction."""
    per_param = [cs for unit_copies in copies for cs in unit_copies]
    if not per_param:
        return ()
    common = set.intersection(*({c for c in cs if c.partial and not c.at_step}
                                for cs in per_param))
    return tuple(c for c in per_param[0] if c in common)


def _guard_freed_params(model: nn.Module, units: list) -> None:
    """Make state_dict()/load_state_dict() of any module holding on-demand unit parameters
    raise while those are freed (their storage is released: reading it would crash)."""
    unit_of = {id(s.param): u for u in units for s in u.slots}
    for m in model.modules():
        mine = list({id(unit_of[id(p)]): unit_of[id(p)] for p in m.parameters()
                     if id(p) in unit_of}.values())
        if mine:
            m.register_state_dict_pre_hook(partial(_refuse_state_dict, mine))
            m.register_load_state_dict_pre_hook(partial(_refuse_load_state_dict, mine))


_FREED = ("the model's parameters are sharded (zero3 / fsdp FULL_SHARD, SHARD_GRAD_OP, "
          "HYBRID_SHARD): between steps each rank holds only its shard and the full tensors are "
          "freed")


def _refuse_state_dict(units, module, prefix, keep_vars) -> None:
    if not keep_vars and not all(u.gathered for u in units):
        raise RuntimeError(f"state_dict() called on a sharded model: {_FREED}; call "
                           f"par.full_state_dict() on every rank (collective; rank0_only=True "
                           f"returns it on rank 0 only) for the consolidated state")


def _refuse_load_state_dict(units, module, state_dict, prefix, *args) -> None:
    if not all(u.gathered for u in units):
        raise RuntimeError(f"load_state_dict() called on a sharded model: {_FREED}; load the "
                           f"state into the model before parallelize(), or resume from an "
                           f"hpctrain checkpoint")


def read_shard_state(reader, u: FlatUnit, name_of=None) -> dict:
    """Optimizer state of unit ``u``'s shard from a checkpoint of global tensors
    (optim/<param>/<key>; ``name_of`` maps a slot's name to the one written): this rank's
    owned elements of each parameter-shaped tensor, per-unit scalars (Adam's step) whole."""
    from hpctrain.checkpoint.layout import from_numpy

    state = {}
    for s in u.slots:
        param = name_of(s.name) if name_of is not None else s.name
        (a, b), _ = u.shard_view(s)
        start = s.offset + a - u.lo
        for k in reader.keys(f"optim/{param}"):
            name = f"optim/{param}/{k}"
            dtype = getattr(torch, reader.dataset(name).attrs["torch_dtype"])
            placed = placement_of(s.param)
            shape = tuple(reader.dataset(name).shape)
            if shape not in ((), tuple(placed.global_shape)):  # another model's: never copied
                reader.fail(f"dataset {name!r} has shape {shape}, parameter {param!r} has "
                            f"{tuple(placed.global_shape)}; resume with the same model")
                continue
            if shape != tuple(placed.global_shape):
                arr = reader.read(name)  # a scalar (Adam's step), kept on the CPU
                if arr is not None:
                    state[k] = from_numpy(np.asarray(arr), dtype).clone()
                continue
            arr = reader.read(name, placed.global_shape, elems=(a, b), box=placed.box(s.shape))
            buf = state.setdefault(k, torch.zeros(u.shard.shape, dtype=dtype,
                                                  device=u.shard.device))
            if arr is not None and b > a:
                buf[start:start + (b - a)].copy_(from_numpy(arr, dtype))
    return state


def nbytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def broadcast_state(model: nn.Module, comm) -> None:
    """Parameters and buffers from rank 0, so a model with random init agrees everywhere."""
    seen = set()
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            # deferred-init placeholders: every rank fills them with the same values
            if id(t) not in seen and t.numel() and not is_placeholder(t):
                seen.add(id(t))
                comm.broadcast(t.detach(), root=0)


def prepare_model(model: nn.Module, world, opts, groups, units=None):
    """What zero and fsdp do before flattening: pick the units (the options' auto-wrap
    policy, or ``units`` a model-parallel transform named), move the model to the device,
    make BatchNorm global over ``groups.batch`` (opts.sync_batchnorm) and start every
    replica from rank 0's values. Returns (model, unit specs, frozen (name, param) pairs)."""
    from hpctrain.parallel.sync_batchnorm import convert_sync_batchnorm
    from hpctrain.parallel.units import partition_modules, rebind, wrapped_modules

    wrapped = [] if units is not None else wrapped_modules(model, opts)  # a bad policy fails here
    to_device(model, world.device)
    if opts.sync_batchnorm:  # batch statistics of the global batch, as in one process
        model = convert_sync_batchnorm(model, groups.batch)
    broadcast_state(model, groups.batch)
    if units is not None:
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        return model, units, frozen
    specs, frozen = partition_modules(model, rebind(model, wrapped))
    return model, specs, frozen
