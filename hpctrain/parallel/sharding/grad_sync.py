"""The sharded engine's gradient reduction: backward hooks, the fixed unit order, the
executor's controls, and the step's synchronize that completes it (``GradSync``).

Gradients are SUMMED (the loop weights each micro-batch by its share of the global batch).
Gradient reductions run in one fixed unit order on every rank, whatever parameters each
rank's graph used, so a branch taken on some ranks only (data-dependent unused parameters)
neither deadlocks nor pairs mismatched collectives. On-demand units driven by the
``GatherSchedule`` (zero3, fsdp FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD) interleave their
gathers with those reductions in one canonical stream that every rank walks in full, forward
and backward (see ``schedule``): a unit is reduced at its CLOSE in that stream; gradients that
arrive after it (a unit whose backward runs out of the canonical order) are reduced again at
the step on every rank, the ranks agreeing on which in the one flag all-reduce the step does
anyway (parameters that got no gradient anywhere; ``agreement``).

Overlapped reduction (Horovod's pattern: start in the hooks, complete in synchronize): a
backward hook starts the ready units' reductions, in the fixed order, as non-blocking pieces
(``reduction.InFlight``, piece buffers capped by ``reduce_bucket_size``; memory_report's
``reduce_buffers`` is their peak, ``reduce_buffers_limit`` the cap's), and tests the
oldest request (Open MPI moves data only inside MPI calls).
``_sync_grads`` starts what the hooks did not (units with a parameter whose hook never
fired, in the same order) and completes all of it.
"""

from __future__ import annotations

import torch
from torch import nn

from hpctrain.parallel.sharding.unit_state import UnitState
from hpctrain.parallel.storage import nbytes
from hpctrain.runtime.malloc import release_free_heap

__all__ = ["GradSync"]


class GradSync:
    """ShardedModel's gradient reduction (a mixin: the engine holds ``plan``, ``comm``,
    ``replicate``, ``partial``, ``schedule``, ``_states``, ``_order`` and ``_reductions``)."""

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

    def _start(self, st: UnitState) -> None:
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
