"""When a sharded unit's full parameters exist: gathered before its forward, freed after it
(or kept until its backward), re-gathered before its backward, with backward prefetch."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

__all__ = ["GatherSchedule"]


def _in_backward() -> bool:
    # A forward that runs inside backward is an activation-checkpointing recompute.
    return torch._C._current_graph_task_id() != -1


class GatherSchedule:
    """Forward hooks that gather units on demand (collective over the units' communicator).

    ``reshard_after_forward``: free a unit after its forward and re-gather it when the
    gradient of its output arrives (zero3, FULL_SHARD); otherwise it stays gathered until its
    backward is over (SHARD_GRAD_OP). ``prefetch``: when a unit is re-gathered for backward,
    also gather the unit that backward reaches next (the one whose forward finished just
    before), so its all-gather is issued before this unit's backward computes: a
    non-blocking one (``FlatUnit.gather_start``) that overlaps that backward and is completed
    when that unit's own backward gathers it. Every rank runs the same graph, so the
    collectives agree.
    """

    def __init__(self, specs, units, reshard_after_forward: bool = True, prefetch: bool = False):
        self.units = list(units)
        self.reshard = reshard_after_forward
        self.prefetch = prefetch
        self.order: list = []          # units in the order their forward finished
        self._prefetched: set = set()  # unit ids prefetched during this backward
        self.peak_gathered = 0         # most bytes of full buffers gathered at once
        for spec, unit in zip(specs, units):
            spec.module.register_forward_pre_hook(partial(self._before_forward, unit))
            spec.module.register_forward_hook(partial(self._after_forward, unit))
            unit.free()

    def gather(self, unit, start: bool = False) -> None:
        """Gather unit (no-op when gathered; ``start``: only start it) and track the bytes
        gathered at once."""
        if start:
            unit.gather_start()
        else:
            unit.gather()
        held = sum(u.full_bytes() for u in self.units
                   if (u.gathered or u.pending) and not u.keep_full)
        self.peak_gathered = max(self.peak_gathered, held)

    def _before_forward(self, unit, module, args) -> None:
        self.gather(unit)

    def _after_forward(self, unit, module, args, output) -> None:
        if not _in_backward():  # the order of the forward pass that backward will walk back
            self.order = [u for u in self.order if u is not unit] + [unit]
        if not self.reshard:
            return
        if torch.is_grad_enabled():
            stack = [output]
            while stack:
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    if o.requires_grad:
                        o.register_hook(partial(self._before_backward, unit))
                elif isinstance(o, (list, tuple)):
                    stack.extend(o)
                elif isinstance(o, dict):
                    stack.extend(o.values())
        unit.free()

    def _before_backward(self, unit, grad) -> None:
        self.gather(unit)
        if self.prefetch and id(unit) not in self._prefetched and unit in self.order:
            self._prefetched.add(id(unit))
            k = self.order.index(unit)
            if k > 0:
                self.gather(self.order[k - 1], start=True)

    def reset_order(self) -> None:
        """Forget the recorded forward order (called after each backward)."""
        self.order = []
        self._prefetched.clear()


def cast_floating_inputs(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the model's floating-point forward inputs to dtype (mixed-precision params)."""
    def hook(module, args, kwargs):
        cast = lambda v: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(hook, with_kwargs=True)
