"""Halo exchange over a Cartesian grid of ranks, as an autograd Function with its adjoint.

Forward fills a rank's WINDOW (its tile plus halo, or any box of the global grid) from the
owners, with non-blocking sends and receives; corners and edges come for free because a
window is cut into boxes that are products of per-dimension runs (decomposition.py).
Backward is the exact adjoint: the gradient of every received box goes back to its owner,
which ADDS it into its tile gradient (DistDL's halo exchange as a linear operator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hpctrain.parallel.domain.decomposition import (coords_rank, rank_coords, split_bounds,
                                                    window_pieces, wrap_mirrors)
from hpctrain.runtime.comm import Communicator
from hpctrain.runtime.comm.base import box_index

__all__ = ["DomainGrid", "HaloPlan", "PendingHalo", "halo_exchange", "halo_finish", "make_plan",
           "start_halo"]

_BACKWARD_TAG = 16384  # adjoint messages use tag + this, so they never match forward ones


class DomainGrid:
    """The domain group seen as a Cartesian grid of ranks over the spatial dims.

    Tiles are the balanced split of the global grid. A layer learns the GLOBAL shape of its
    input from the local one by an allgather over the group; inside ``begin(key)`` ...
    ``end`` (a forward pass the strategy keys by the model's global input shape) the answers
    are cached per call, so every rank makes the same collectives in the same order and the
    steady state has none.
    """

    def __init__(self, comm: Communicator, shape: tuple[int, ...]):
        shape = tuple(int(v) for v in shape)
        if math.prod(shape) != comm.size:
            raise ValueError(f"a domain grid of shape {'x'.join(map(str, shape))} needs "
                             f"{math.prod(shape)} ranks but the domain group has {comm.size}")
        self.comm = comm
        self.shape = shape
        self.ndim = len(shape)
        self.coords = rank_coords(comm.rank, shape)
        self._key = None
        self._ordinal = 0
        self._cache: dict = {}

    def begin(self, key) -> None:
        """Start a forward pass whose layer shapes depend only on ``key`` (same on all ranks)."""
        self._key, self._ordinal = key, 0

    def end(self) -> None:
        self._key = None

    def bounds(self, global_shape: tuple[int, ...]) -> list[list[tuple[int, int]]]:
        """Per spatial dim, the [start, stop) of every grid coordinate."""
        return [split_bounds(n, p) for n, p in zip(global_shape, self.shape)]

    def tile(self, global_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's tile [lo, hi) of a global grid."""
        b = self.bounds(global_shape)
        return (tuple(b[d][c][0] for d, c in enumerate(self.coords)),
                tuple(b[d][c][1] for d, c in enumerate(self.coords)))

    def global_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """Global spatial shape of a tensor whose local tile has shape ``local`` (collective)."""
        local = tuple(int(v) for v in local)
        if self.comm.size == 1:
            return local
        key = None if self._key is None else (self._key, self._ordinal)
        self._ordinal += 1
        if key in self._cache:
            mine, glob = self._cache[key]
            if mine != local:
                raise RuntimeError(f"domain layer call {key[1]} saw a local tile {local} where "
                                   f"the same forward pass saw {mine} before; the model's shapes "
                                   "must depend only on its input shape")
            return glob
        # on the device communicator (NCCL, or MPI staged from a GPU): a device tensor
        mine = torch.tensor(local, dtype=torch.int64, device=self.comm.device)
        sizes = self.comm.allgather(mine).view(self.comm.size, -1).cpu()
        glob = []
        for d in range(self.ndim):
            line = [int(sizes[coords_rank(self.coords[:d] + (c,) + self.coords[d + 1:], self.shape), d])
                    for c in range(self.shape[d])]
            n = sum(line)
            if [b - a for a, b in split_bounds(n, self.shape[d])] != line:
                raise ValueError(f"spatial dim {d}: tiles {line} along the rank grid are not the "
                                 f"balanced split of {n} points; domain tensors must be split "
                                 "with DomainGrid.tile()")
            glob.append(n)
        glob = tuple(glob)
        if key is not None:
            self._cache[key] = (local, glob)
        return glob


@dataclass
class HaloPlan:
    """What this rank copies, fills, receives and sends to build its window.

    ``recv``/``send`` list boxes (peer, tag, slices); on the wire every peer gets ONE
    message per exchange holding all its boxes in tag order (corners and edges included),
    described in place by the communicator (MPI derived datatypes: no packing copies).
    ``mirrors`` are window-to-window copies made once the messages are in: the wrapped
    runs of periodic dims that one rank spans (decomposition.wrap_mirrors). The backward
    runs the adjoint of ``unmirrored``, the same window cut into pieces only (the same
    linear map), so it never writes into its incoming gradient.
    """

    window_shape: tuple[int, ...]
    local: list = field(default_factory=list)   # (src slices, dst slices)
    fills: list = field(default_factory=list)   # dst slices
    recv: list = field(default_factory=list)    # (peer, tag, dst slices)
    send: list = field(default_factory=list)    # (peer, tag, src slices)
    fill: float = 0.0
    mirrors: list = field(default_factory=list)  # (dst index, src index) of the window
    unmirrored: HaloPlan | None = None
    _windows: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _messages: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def communicates(self) -> bool:
        return bool(self.recv or self.send)

    @property
    def recv_messages(self) -> list:
        """[(peer, tag, boxes)], one per peer, boxes ((start, stop) per dim) in tag order."""
        if "recv" not in self._messages:
            self._messages["recv"] = _by_peer(self.recv)
        return self._messages["recv"]

    @property
    def send_messages(self) -> list:
        """[(peer, tag, boxes)], one per peer, boxes in the receiver's tag order."""
        if "send" not in self._messages:
            self._messages["send"] = _by_peer(self.send)
        return self._messages["send"]

    def exchange(self, comm: Communicator):
        """The forward messages prepared on ``comm`` (checked once, started every call)."""
        got = self._messages.get("exchange")
        if got is None or got[0] is not comm:
            got = self._messages["exchange"] = (
                comm, comm.boxes_exchange(self.recv_messages, self.send_messages))
        return got[1]

    def tile_slices(self, tile_shape: tuple[int, ...]):
        """The local copy that covers the whole tile (src, dst), or None."""
        for src, dst in self.local:
            if all(s.start == 0 and s.stop == n for s, n in zip(src, tile_shape)):
                return src, dst
        return None

    def window_buffer(self, lead: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A window tensor for this plan, reusing the last one when nothing else holds it.

        A fresh multi-MB window per call page-faults its whole extent; reusing it is safe
        once autograd has released it (backward done), which the storage's use count tells:
        the cache holds the base tensor and its storage, every window handed out one more.
        Boundary fills are written once, when the buffer is made (nothing else writes there).
        """
        key = (lead, like.dtype, like.device)
        entry = self._windows.get(key)
        if entry is None or not _unused(entry[1]):
            base = torch.empty(lead + self.window_shape, dtype=like.dtype, device=like.device)
            for dst in self.fills:
                base[_ix(dst)] = self.fill
            entry = (base, base.untyped_storage())
            self._windows[key] = entry
        return entry[0].detach()  # a new tensor on the same storage (counted by _unused)


def _by_peer(boxes: list) -> list:
    out: dict = {}
    for peer, tag, slices in sorted(boxes, key=lambda b: (b[0], b[1])):
        out.setdefault(peer, (peer, tag, []))[2].append(tuple((s.start, s.stop) for s in slices))
    return [(peer, tag, tuple(bx)) for peer, tag, bx in out.values()]


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # absent: never reuse, always safe


def _unused(storage) -> bool:
    """True when only the window cache refers to this storage (its tensor and itself)."""
    return _USE_COUNT is not None and _USE_COUNT(storage._cdata) <= 2


def make_plan(grid: DomainGrid, global_shape: tuple[int, ...], boxes: list, periodic: tuple[bool, ...],
              fill: float = 0.0) -> HaloPlan:
    """Plan the exchange that gives every rank q the global box ``boxes[q] = (lo, hi)``."""
    bounds = grid.bounds(global_shape)
    full = _pieces_plan(grid, bounds, boxes, periodic, fill, [None] * len(boxes))
    flags = [wrap_mirrors(lo, hi, bounds, grid.shape, periodic) for lo, hi in boxes]
    if not any(m for _, m in flags):
        return full
    plan = _pieces_plan(grid, bounds, boxes, periodic, fill, [f for f, _ in flags])
    nd = len(plan.window_shape)
    for d, (a, b), (c, e) in flags[grid.comm.rank][1]:
        pad = (slice(None),) * d, (slice(None),) * (nd - 1 - d)
        plan.mirrors.append(((Ellipsis, *pad[0], slice(a, b), *pad[1]),
                             (Ellipsis, *pad[0], slice(c, e), *pad[1])))
    plan.unmirrored = full
    return plan


def _pieces_plan(grid, bounds, boxes, periodic, fill, mirrored) -> HaloPlan:
    """The plan of ``boxes`` cut into pieces (``mirrored[q]``: rank q's mirrored dims)."""
    me = grid.comm.rank
    lo, hi = boxes[me]
    plan = HaloPlan(tuple(b - a for a, b in zip(lo, hi)), fill=fill)
    for tag, p in enumerate(window_pieces(lo, hi, bounds, grid.shape, periodic, mirrored[me])):
        if p.owner is None:
            plan.fills.append(p.dst)
        elif p.owner == me:
            plan.local.append((p.src, p.dst))
        else:
            plan.recv.append((p.owner, tag, p.dst))
    for q, (qlo, qhi) in enumerate(boxes):
        if q == me:
            continue
        for tag, p in enumerate(window_pieces(qlo, qhi, bounds, grid.shape, periodic,
                                              mirrored[q])):
            if p.owner == me:
                plan.send.append((q, tag, p.src))
    return plan


def _ix(slices) -> tuple:
    return (Ellipsis,) + tuple(slices)


class PendingHalo:
    """An exchange in flight: receives and sends posted, local copies done; ``finish()`` waits.

    Receives land straight in the window and sends leave straight from x (strided boxes);
    the tile's own copy into the window runs while the messages are in flight. ``x`` must
    not record autograd ops here: pass it detached, or build this inside a Function.
    """

    def __init__(self, x: torch.Tensor, plan: HaloPlan, comm: Communicator):
        self.plan, self.comm = plan, comm
        self.window = plan.window_buffer(x.shape[:x.dim() - len(plan.window_shape)], x)
        self._req = plan.exchange(comm).start(self.window, x) if plan.communicates else None
        for src, dst in plan.local:
            self.window[_ix(dst)] = x[_ix(src)]

    def finish(self) -> torch.Tensor:
        """Wait for the halos and return the filled window."""
        if self._req is not None:
            self._req.wait()
            self._req = None
        for dst, src in self.plan.mirrors:
            self.window[dst] = self.window[src]
        return self.window


def _adjoint(ctx, g):
    """x_grad = H* window_grad: every received box's gradient goes back to its owner, which
    adds it into its tile gradient (with the local copies' gradients)."""
    plan, comm = ctx.plan.unmirrored or ctx.plan, ctx.comm
    nd = len(plan.window_shape)
    lead = ctx.shape[:len(ctx.shape) - nd]
    recvs = []
    for peer, tag, boxes in plan.send_messages:
        shapes = [lead + tuple(b - a for a, b in box) for box in boxes]
        buf = torch.empty(sum(math.prod(sh) for sh in shapes), dtype=g.dtype, device=g.device)
        recvs.append((comm.irecv(buf, peer, tag + _BACKWARD_TAG), buf, shapes, boxes))
    sends = [comm.isend_boxes(g, boxes, peer, tag + _BACKWARD_TAG)
             for peer, tag, boxes in plan.recv_messages]
    whole = plan.tile_slices(ctx.shape[len(lead):])
    if whole is not None:  # one copy instead of zeros + add
        gx = g[_ix(whole[1])].clone(memory_format=torch.contiguous_format)
    else:
        gx = torch.zeros(ctx.shape, dtype=g.dtype, device=g.device)
    for src, dst in plan.local:
        if whole is None or (src, dst) != whole:
            gx[_ix(src)] += g[_ix(dst)]
    for req, buf, shapes, boxes in recvs:
        req.wait()
        start = 0
        for shape, box in zip(shapes, boxes):
            n = math.prod(shape)
            gx[box_index(box)] += buf[start:start + n].view(shape)
            start += n
    for req in sends:
        req.wait()
    return gx


class _HaloFinish(torch.autograd.Function):
    """window = H x for an exchange started earlier (overlap); backward: the adjoint."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.plan, ctx.comm, ctx.shape = pending.plan, pending.comm, x.shape
        return pending.finish()

    @staticmethod
    def backward(ctx, g):
        return _adjoint(ctx, g), None


class _HaloExchange(torch.autograd.Function):
    """window = H x, started and finished here: one autograd node, no Python in between."""

    @staticmethod
    def forward(ctx, x, plan, comm):
        ctx.plan, ctx.comm, ctx.shape = plan, comm, x.shape
        window = plan.window_buffer(x.shape[:x.dim() - len(plan.window_shape)], x)
        req = plan.exchange(comm).start(window, x) if plan.communicates else None
        for src, dst in plan.local:  # the tile's own copy, while the halos fly
            window[_ix(dst)] = x[_ix(src)]
        if req is not None:
            req.wait()
        for dst, src in plan.mirrors:  # wrapped runs (corners too), from the window itself
            window[dst] = window[src]
        return window

    @staticmethod
    def backward(ctx, g):
        return _adjoint(ctx, g), None, None


def _direct_apply(fn):
    """``fn.apply`` without the Python wrapper of ``Function.apply``, which only serves
    functorch transforms and ``setup_context`` (neither meets a halo exchange) and costs ~10
    us per call once a large exchange has left the caches cold (bench halo); the wrapper is
    kept while a functorch transform is active."""
    direct = super(torch.autograd.Function, fn).apply  # torch._C._FunctionBase.apply
    active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return fn.apply(*args) if active() else direct(*args)
    return apply


_exchange_apply = _direct_apply(_HaloExchange)
_finish_apply = _direct_apply(_HaloFinish)


def start_halo(x: torch.Tensor, plan: HaloPlan, comm: Communicator) -> PendingHalo:
    """Post the exchange of ``plan`` for x (point to point over comm); finish with halo_finish."""
    return PendingHalo(x.detach(), plan, comm)


def halo_finish(x: torch.Tensor, pending: PendingHalo) -> torch.Tensor:
    """Wait for a started exchange and return the window, differentiably in x."""
    return _finish_apply(x, pending)


def halo_exchange(x: torch.Tensor, plan: HaloPlan, comm: Communicator) -> torch.Tensor:
    """Return this rank's window of the global tensor tiled as x (collective over the plan's peers)."""
    return _exchange_apply(x, plan, comm)
