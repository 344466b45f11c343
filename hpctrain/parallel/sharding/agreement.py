"""What the ranks of the sharded engine agree on at the step (``Agreement``): which
parameters got a gradient anywhere, which units had late gradients, the count of
out-of-stream gathers, and, once, that copies placed as 'the same' got equal gradients."""

from __future__ import annotations

import torch

from hpctrain.parallel.placement import placement_of

__all__ = ["Agreement"]


class Agreement:
    """ShardedModel's agreement flags (a mixin: the engine holds ``comm``, ``replicate``,
    ``partial``, ``schedule``, ``_states`` and ``_agreed``)."""

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
