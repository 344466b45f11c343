"""When a sharded unit's full parameters exist: gathered before its forward, freed after it
(or kept until its backward), re-gathered before its backward, with backward prefetch.

The all-gathers are collectives, so every rank must issue the same ones in the same order,
even where the ranks' graphs differ (a branch of the model taken on some ranks only). They
therefore follow one CANONICAL order of events, fixed at wrap time from the module tree, that
every rank walks in full in each forward and each backward, whatever modules it runs:

- forward: the units' gathers in pre-order of the module tree (the root unit first, then
  the wrapped modules in registration order, an outer unit before the units inside it).
  When a unit's module is about to run, every unit before it in this order that was not
  gathered yet in this forward is gathered first; a unit this rank skips is so gathered and
  at once freed again (FULL_SHARD, zero3; SHARD_GRAD_OP keeps it until backward, as every
  unit, so that all ranks hold the same units), and the end of the forward (the root
  module's forward hook) catches up to the end of the order.
- backward: the forward's events reversed, a unit's gather (fired by the gradient of its
  output, or by an activation-checkpointing recompute) where its forward ended and its
  CLOSE (freed, gradients reduce-scattered by ``ShardedModel``) where its forward began;
  the gathers and the reductions share one stream, as they share the communicator. A close
  happens when the unit's gradients are complete and the stream has reached it, or when a
  later event must happen first (it then reduces what arrived: nothing, on a rank that skipped
  the unit); the end of backward (``finish_backward``) walks the rest and frees every unit.
  A unit this rank skipped is gathered at its place and freed at once; a unit that ran but
  is passed before its backward comes, or closed before its gradients are all in (a
  parameter without gradient), stays gathered until the end of backward (no second gather).
  Gradients that arrive after their unit's close (a unit whose backward runs out of the
  canonical order) are reduced once more at the step, on every rank (the engine agrees on
  which in the flag all-reduce the step does anyway). BACKWARD_PRE prefetch moves each gather
  one gather earlier in the stream (the same on every rank). In grad accumulation's earlier
  micro-batches a close only frees.
- a recompute (activation checkpointing) runs inside backward: its gathers are part of the
  backward stream, and the unit stays gathered for its backward that follows.
- a forward under ``torch.no_grad`` (evaluation) walks the forward stream in full too, so
  ranks may evaluate different branches; under SHARD_GRAD_OP every unit then stays gathered,
  on every rank, until the next backward or step frees them.

So ranks may skip any units, as long as the units each rank runs run in the canonical
order, once per forward, with one forward per backward. A unit that runs again after the
stream has passed it and freed it (used twice in one forward under FULL_SHARD / zero3, a
module run out of registration order, a second forward before one backward) is gathered once
more, out of the stream: safe when every rank does the same (the same graph everywhere, as
all models without data-dependent branches: they train correctly, at the cost of
that extra gather), a mismatched pairing or a hang when only some ranks do (say a
data-dependent number of loop iterations over one block). That cannot be seen before the
collectives are issued; the ranks' counts of such gathers are compared at each step and a
difference raises (``ooo_gathers``) where the run did not hang first, instead of training
on silently wrong parameters.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

__all__ = ["GatherSchedule"]

_OPEN, _CLOSE = "open", "close"


def _in_backward() -> bool:
    # A forward that runs inside backward is an activation-checkpointing recompute.
    return torch._C._current_graph_task_id() != -1


def _events(root: nn.Module, modules: list) -> list:
    """The forward's unit events in the canonical order: (_OPEN, i) when unit i's module
    starts, (_CLOSE, i) when it ends, in a walk of root's module tree (pre-order opens,
    post-order closes); a unit module outside the tree goes last."""
    index = {id(m): i for i, m in enumerate(modules) if m is not None}
    out, seen = [], set()
    stack = [(root, False)]
    while stack:
        m, done = stack.pop()
        i = index.get(id(m))
        if done:
            if i is not None:
                out.append((_CLOSE, i))
            continue
        if id(m) in seen:
            continue
        seen.add(id(m))
        if i is not None:
            out.append((_OPEN, i))
        stack.append((m, True))
        stack.extend((c, False) for c in reversed(list(m.children())))
    placed = {i for _, i in out}
    for i, m in enumerate(modules):
        if m is not None and i not in placed:
            out += [(_OPEN, i), (_CLOSE, i)]
    return out


def _prefetched(events: list, fits) -> list:
    """Backward events with each gather moved one gather earlier when its unit ``fits`` the
    prefetch budget: the first gather brings the second along, and each later gather happens
    where the one before it was (BACKWARD_PRE: the next unit's all-gather is issued before
    this unit's backward computes). A unit that does not fit keeps its own place."""
    opens = [i for kind, i in events if kind == _OPEN]
    out, slot, moved = [], 0, set()
    for kind, i in events:
        if kind == _CLOSE:
            out.append((kind, i))
            continue
        if i not in moved:
            out.append((_OPEN, i))
        if slot + 1 < len(opens) and fits(opens[slot + 1]):
            moved.add(opens[slot + 1])
            out.append((_OPEN, opens[slot + 1]))
        slot += 1
    return out


class GatherSchedule:
    """Forward hooks that gather units in one canonical stream (see the module docstring;
    collective over the units' communicator).

    ``reshard_after_forward``: free a unit after its forward and re-gather it when the
    gradient of its output arrives (zero3, FULL_SHARD); otherwise it stays gathered until its
    backward is over (SHARD_GRAD_OP). ``prefetch``: when a unit is re-gathered for backward,
    the unit that backward reaches next is gathered too, so its all-gather is issued before
    this unit's backward computes: non-blocking (``FlatUnit.gather_start``), so it overlaps
    that backward, and is completed when the unit is needed or freed; only a unit whose full
    buffer fits ``prefetch_bytes`` (``allgather_bucket_size``) is gathered ahead, so at most
    that many bytes are (one unit ahead at a time). ``root``: the model (its forward starts
    and ends each pass); default the last unit's module (the root unit).

    The engine calls ``begin_backward`` / ``finish_backward`` around each backward and
    ``complete(i)`` when unit i's gradients have all arrived; ``on_close(i)`` (set by the
    engine) is called at unit i's close, after it is freed, to reduce its gradients.
    """

    def __init__(self, specs, units, reshard_after_forward: bool = True, prefetch: bool = False,
                 root: nn.Module | None = None, prefetch_bytes: int | None = None):
        self.units = list(units)
        self.reshard = reshard_after_forward
        self.prefetch = prefetch
        self.prefetch_bytes = prefetch_bytes  # None: any unit may be gathered ahead
        self.peak_gathered = 0         # most bytes of full buffers gathered at once
        self.peak_prefetched = 0       # most bytes gathered ahead of need (started, pending)
        self.prefetch_buffer = 0       # the largest unit the budget lets be gathered ahead
        self.ooo_gathers = 0           # gathers outside the canonical stream (see module doc)
        self.on_close = None           # the engine's reduction of a closed unit
        modules = [spec.module for spec in specs]
        root = root if root is not None else modules[-1]
        fwd = _events(root, modules)
        self._fwd = [i for kind, i in fwd if kind == _OPEN]  # forward: only gathers collect
        self._fpos = {i: k for k, i in enumerate(self._fwd)}
        bwd = [(_CLOSE if kind == _OPEN else _OPEN, i) for kind, i in reversed(fwd)]
        fits = [prefetch_bytes is None or u.full_bytes() <= prefetch_bytes for u in units]
        self._fits = fits  # units the prefetch budget lets be gathered ahead
        if prefetch and reshard_after_forward:
            bwd = _prefetched(bwd, lambda i: fits[i])
            # Any unit that fits but the first backward needs may be gathered ahead: moved
            # one gather earlier, or next in the stream already (a unit nested in another).
            first = next((i for kind, i in bwd if kind == _OPEN), None)
            self.prefetch_buffer = max((u.full_bytes() for i, u in enumerate(units)
                                        if fits[i] and i != first), default=0)
        self._bwd = bwd
        self._bopen = {i: k for k, (kind, i) in enumerate(bwd) if kind == _OPEN}
        self._f = 0                    # next forward gather (index into _fwd)
        self._b = len(bwd)             # next backward event (index into _bwd)
        self.ran: set = set()          # units whose module ran in this step's forward(s)
        self._pending = False          # a forward with grad enabled awaits its backward
        self._needed: set = set()      # units gathered for their backward in this backward
        self._complete: set = set()    # units whose gradients are complete in this backward
        self.closed: set = set()       # units closed in this backward
        root.register_forward_pre_hook(self._start_forward, prepend=True)
        for i, spec in enumerate(specs):
            spec.module.register_forward_pre_hook(partial(self._before_forward, i))
            spec.module.register_forward_hook(partial(self._after_forward, i))
        root.register_forward_hook(self._end_forward)
        for unit in units:
            unit.free()

    def close_order(self) -> list:
        """Unit indices in the order backward closes (reduces) them."""
        return [i for kind, i in self._bwd if kind == _CLOSE]

    def gather(self, unit, start: bool = False) -> None:
        """Gather unit (no-op when gathered; ``start``: only start it, non-blocking) and
        track the bytes gathered (or being gathered) at once."""
        if start:
            unit.gather_start()
        else:
            unit.gather()
        held = sum(u.full_bytes() for u in self.units
                   if (u.gathered or u.pending) and not u.keep_full)
        self.peak_gathered = max(self.peak_gathered, held)

    def _note_ahead(self) -> None:
        """Track the bytes gathered ahead of need: gathers started and left pending."""
        ahead = sum(u.full_bytes() for u in self.units if u.pending and not u.keep_full)
        self.peak_prefetched = max(self.peak_prefetched, ahead)

    def _gather_out_of_stream(self, i: int) -> None:
        unit = self.units[i]
        if unit.pending:  # prefetched: complete it (no new collective)
            self.gather(unit)
        elif not unit.gathered:
            self.ooo_gathers += 1
            self.gather(unit)

    # ---- forward -----------------------------------------------------------------------

    def _start_forward(self, module, args) -> None:
        if _in_backward():
            return
        self._f = 0
        if not self._pending:  # no backward owes anything to an earlier forward
            self.ran = set()

    def _advance_forward(self, to: int) -> None:
        """Gather, in canonical order, the units before position ``to`` not gathered yet in
        this forward: this rank passes over them, so they are freed again at once
        (SHARD_GRAD_OP keeps them, as every unit, until backward)."""
        while self._f < to:
            unit = self.units[self._fwd[self._f]]
            self._f += 1
            if not unit.gathered:  # (SHARD_GRAD_OP after a forward without backward: all are)
                self.gather(unit)
                if self.reshard:
                    unit.free()

    def _before_forward(self, i: int, module, args) -> None:
        if _in_backward():  # an activation-checkpointing recompute: part of backward
            self._need(i)
            return
        self.ran.add(i)
        k = self._fpos[i]
        if k < self._f:  # run again after the stream passed it (see the module docstring)
            self._gather_out_of_stream(i)
            return
        self._advance_forward(k)
        self._f = k + 1
        self.gather(self.units[i])

    def _after_forward(self, i: int, module, args, output) -> None:
        if self.reshard and torch.is_grad_enabled():
            stack = [output]
            while stack:
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    if o.requires_grad:
                        o.register_hook(partial(self._before_backward, i))
                elif isinstance(o, (list, tuple)):
                    stack.extend(o)
                elif isinstance(o, dict):
                    stack.extend(o.values())
        if self.reshard and not _in_backward():  # a recompute's unit backward comes next
            self.units[i].free()

    def _end_forward(self, module, args, output) -> None:
        if _in_backward():
            return
        self._advance_forward(len(self._fwd))
        if torch.is_grad_enabled():
            self._pending = True

    # ---- backward ----------------------------------------------------------------------

    def begin_backward(self) -> None:
        """A backward starts: its stream from the beginning."""
        self._b = 0
        self._needed, self._complete, self.closed = set(), set(), set()

    def _before_backward(self, i: int, grad) -> None:
        self._need(i)

    def _need(self, i: int) -> None:
        """Unit i's params are needed in backward (its output's gradient arrived, or a
        recompute runs it): walk the stream to its gather (and prefetch one ahead)."""
        self._needed.add(i)
        # Gathers on the way to unit i's are of units needed later (prefetch): only started.
        self._advance_backward(self._bopen[i] + 1, needed=i)
        self._gather_out_of_stream(i)
        if self.prefetch and self._b < len(self._bwd) and self._bwd[self._b][0] == _OPEN \
                and self._fits[self._bwd[self._b][1]]:
            self._do(self._b, start=True)  # non-blocking: overlaps this unit's backward
        self._voluntary()

    def complete(self, i: int) -> None:
        """Unit i's gradients have all arrived in this backward (the engine's hook)."""
        self._complete.add(i)
        if i not in self.closed:
            self._voluntary()

    def _voluntary(self) -> None:
        """Walk on while the next events need nothing more of this backward: closes of
        complete units and the gathers and closes of units this rank's forward skipped."""
        while self._b < len(self._bwd):
            kind, i = self._bwd[self._b]
            if kind == _OPEN:  # a unit this rank runs: gathered when needed (SHARD_GRAD_OP:
                if i in self.ran and self.reshard:  # still gathered since its forward)
                    return
            elif i in self.ran and i not in self._complete:
                return
            self._do(self._b)

    def _advance_backward(self, to: int, needed: int | None = None) -> None:
        while self._b < to:
            self._do(self._b, start=needed is not None and self._bwd[self._b][1] != needed)

    def _do(self, k: int, start: bool = False) -> None:
        """Event k of the backward stream (collective: a gather, or the engine's reduction;
        ``start``: a gather only started, completed when the unit is needed or freed)."""
        kind, i = self._bwd[k]
        self._b = k + 1
        unit = self.units[i]
        if kind == _OPEN:
            # Every backward-stream gather is started non-blocking, on every rank: MPI never
            # matches a blocking collective with a non-blocking one, and whether a rank
            # needs the unit right now (or only prefetches it) differs between ranks.
            self.gather(unit, start=True)
            if not start:
                self.gather(unit)  # needed now: complete it
            else:
                self._note_ahead()
            if i not in self.ran and i not in self._needed:
                unit.free()  # a unit this rank skipped: only its place in the stream
            return
        self.closed.add(i)
        # A unit whose module ran but whose gradients are not all in may still be in its
        # backward (or get none at all): it stays gathered until the end of backward.
        if i in self._complete or i not in self.ran:
            unit.free()
        if self.on_close is not None:
            self.on_close(i)

    def finish_backward(self) -> None:
        """A backward is over: walk the rest of its stream, free every unit."""
        self._advance_backward(len(self._bwd))
        for unit in self.units:
            unit.free()
        self._pending = False
        self.ran = set()


def cast_floating_inputs(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the model's floating-point forward inputs to dtype (mixed-precision params)."""
    def hook(module, args, kwargs):
        cast = lambda v: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    model.register_forward_pre_hook(hook, with_kwargs=True)
