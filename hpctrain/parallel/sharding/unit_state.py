"""Per-unit bookkeeping of the sharded engine: one unit's gradient flags for the step, the
partial groups its gradients are summed over, and each parameter's weight in global norms."""

from __future__ import annotations

import torch

from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.placement import Placement

__all__ = ["UnitState", "common_partial", "step_partials"]


class UnitState:
    """Per-step bookkeeping of one unit's gradients, and where its parameters live."""

    def __init__(self, unit: FlatUnit, copies: list, replicas: tuple, common: tuple = ()):
        self.unit = unit
        # Partial groups summed at the step, after the unit's reduction: (comm, slots: None
        # for the whole unit). Those summed only at the step (ranks running different
        # pipeline stages hold a tied weight), and those only some of the unit's parameters
        # are partial over (under sequence parallel a LayerNorm ran on sequence chunks, the
        # tensor-parallel weights beside it did not).
        self.partial = step_partials(unit, copies, common)
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


def step_partials(u: FlatUnit, copies: list, common: tuple) -> list:
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


def common_partial(units: list, copies: list) -> tuple:
    """The partial groups (not only at the step) that EVERY parameter of every unit is
    partial over (a domain split's tiles): summed with each unit's reduction."""
    per_param = [cs for unit_copies in copies for cs in unit_copies]
    if not per_param:
        return ()
    common = set.intersection(*({c for c in cs if c.partial and not c.at_step}
                                for cs in per_param))
    return tuple(c for c in per_param[0] if c in common)
