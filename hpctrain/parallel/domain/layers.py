"""Domain-parallel layers: each rank computes its tile of the output from its window.

A window op (conv, pooling, nearest upsampling) learns its global input shape, plans the
halo exchange for it once, fills its window and applies the plain torch op with no padding
(the halo holds the boundary: zeros, -inf for max pooling, or the wrapped-around values of
a periodic grid). With ``overlap`` the interior of the tile, which needs no halo, is
computed while the halos are in flight; only the shell waits for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.domain.decomposition import (LinearUpGeometry, WindowGeometry, rank_coords,
                                                    split_bounds)
from hpctrain.parallel.domain.halo import (DomainGrid, halo_exchange, halo_finish, make_plan,
                                           start_halo)

__all__ = ["DomainWindowOp", "DomainConv", "DomainConvFn", "DomainPool", "DomainUpsample",
           "DomainLinearUp", "domain_upsample"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


class _Layout:
    """Everything a window op needs for one global input shape (computed once, cached)."""

    def __init__(self, grid: DomainGrid, geoms, periodic, fill, global_in):
        self.global_in = global_in
        self.global_out = tuple(g.out_size(n) for g, n in zip(geoms, global_in))
        if any(m < grid.shape[d] for d, m in enumerate(self.global_out)):
            raise ValueError(f"output grid {self.global_out} (from input {global_in}) has fewer "
                             f"points than the rank grid {'x'.join(map(str, grid.shape))} in some "
                             "dimension; use fewer domain ranks or a larger grid")
        out_b = [split_bounds(m, p) for m, p in zip(self.global_out, grid.shape)]
        boxes = []
        for q in range(grid.comm.size):
            c = rank_coords(q, grid.shape)
            w = [g.window(*out_b[d][c[d]]) for d, g in enumerate(geoms)]
            boxes.append((tuple(a for a, _ in w), tuple(b for _, b in w)))
        me = grid.comm.rank
        self.out_lo, self.out_hi = grid.tile(self.global_out)
        self.win_lo = boxes[me][0]
        self.in_lo, self.in_hi = grid.tile(global_in)
        self.plan = make_plan(grid, global_in, boxes, periodic, fill)
        tile = tuple(b - a for a, b in zip(self.in_lo, self.in_hi))
        # The window IS the tile (1x1 convs, even pools, upsampling): no exchange, no copy.
        self.identity = (not self.plan.communicates and not self.plan.fills
                         and not self.plan.mirrors
                         and self.plan.window_shape == tile
                         and self.plan.tile_slices(tile) is not None and len(self.plan.local) == 1)
        inner = [g.interior(o0, o1, i0, i1) for g, o0, o1, i0, i1
                 in zip(geoms, self.out_lo, self.out_hi, self.in_lo, self.in_hi)]
        self.inner_lo = tuple(a for a, _ in inner)
        self.inner_hi = tuple(b for _, b in inner)
        # Overlap needs an interior AND a shell: the window must feed the output, or this
        # rank's adjoint (which other ranks wait on in backward) would never run.
        self.has_interior = all(a < b for a, b in inner) and (
            self.inner_lo != self.out_lo or self.inner_hi != self.out_hi)


class DomainWindowOp(nn.Module):
    """Base of the window ops; subclasses give ``geoms`` and ``_compute``."""

    def __init__(self, grid: DomainGrid, geoms, periodic=False, fill=0.0, overlap=False):
        super().__init__()
        if len(geoms) != grid.ndim:
            raise ValueError(f"{type(self).__name__}: a {len(geoms)}-d layer on a {grid.ndim}-d "
                             "domain grid; the model's spatial dims must match the grid's")
        self.grid = grid
        self.geoms = tuple(geoms)
        self.periodic = (bool(periodic),) * grid.ndim
        self.fill = fill
        self.overlap = overlap
        self.plain = False  # set while called on a tensor every rank holds whole (functional.py)
        self._layouts: dict = {}

    def _layout(self, x: torch.Tensor) -> _Layout:
        nd = self.grid.ndim
        glob = self.grid.global_shape(tuple(x.shape[-nd:]))
        if glob not in self._layouts:
            self._layouts[glob] = _Layout(self.grid, self.geoms, self.periodic, self.fill, glob)
        return self._layouts[glob]

    def _compute(self, inp: torch.Tensor, in_lo, out_lo, out_hi) -> torch.Tensor:
        """Output box [out_lo, out_hi) from ``inp``, the input window starting at global in_lo."""
        raise NotImplementedError

    def _input_box(self, lo, hi, origin):
        """Slices of the input (starting at global ``origin``) that outputs [lo, hi) read."""
        w = [g.window(a, b) for g, a, b in zip(self.geoms, lo, hi)]
        return (Ellipsis,) + tuple(slice(a - o, b - o) for (a, b), o in zip(w, origin)), \
            tuple(a for a, _ in w)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """The op on a tensor that is not split (e.g. a 1x1 conv on a pooled gate): the
        boundary padded here as the halo would fill it, no exchange."""
        pads = [p for g in reversed(self.geoms) for p in (g.pad_lo, g.pad_hi)]
        if any(pads):
            x = (F.pad(x, pads, mode="circular") if any(self.periodic)
                 else F.pad(x, pads, value=self.fill))
        n = tuple(x.shape[-self.grid.ndim:])
        out = tuple(g.out_size(m - g.pad_lo - g.pad_hi) for g, m in zip(self.geoms, n))
        return self._compute(x, tuple(-g.pad_lo for g in self.geoms), (0,) * len(n), out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return self._whole(x)
        lay = self._layout(x)
        comm = self.grid.comm
        if lay.identity:
            return self._compute(x, lay.win_lo, lay.out_lo, lay.out_hi)
        if not (self.overlap and lay.plan.communicates and lay.has_interior):
            window = halo_exchange(x, lay.plan, comm)
            return self._compute(window, lay.win_lo, lay.out_lo, lay.out_hi)
        pending = start_halo(x, lay.plan, comm)
        ix, in_lo = self._input_box(lay.inner_lo, lay.inner_hi, lay.in_lo)
        inner = self._compute(x[ix], in_lo, lay.inner_lo, lay.inner_hi)  # while halos fly
        window = halo_finish(x, pending)
        return self._shell(window, lay, inner, 0, list(lay.out_lo), list(lay.out_hi))

    def _shell(self, window, lay, inner, d, lo, hi):
        """Assemble the output: below-interior slab, middle (recursing), above-interior slab."""
        if d == self.grid.ndim:
            return inner
        parts = []
        for a, b in ((lay.out_lo[d], lay.inner_lo[d]), (None, None), (lay.inner_hi[d], lay.out_hi[d])):
            if a is None:
                mid_lo, mid_hi = list(lo), list(hi)
                mid_lo[d], mid_hi[d] = lay.inner_lo[d], lay.inner_hi[d]
                parts.append(self._shell(window, lay, inner, d + 1, mid_lo, mid_hi))
            elif a < b:
                blo, bhi = list(lo), list(hi)
                blo[d], bhi[d] = a, b
                ix, in_lo = self._input_box(blo, bhi, lay.win_lo)
                parts.append(self._compute(window[ix], in_lo, blo, bhi))
        return torch.cat(parts, dim=inner.dim() - self.grid.ndim + d)


def _resolve_padding(padding, kernel, dilation, nd):
    """(lo, hi) per dim from torch's padding argument ('same', 'valid', int or tuple)."""
    if isinstance(padding, str):
        if padding == "valid":
            return [(0, 0)] * nd
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return [(t // 2, t - t // 2) for t in total]  # torch puts the odd one on the right
    padding = (padding,) * nd if isinstance(padding, int) else tuple(padding)
    return [(p, p) for p in padding]


def _tuple(v, nd):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


class DomainConv(DomainWindowOp):
    """Conv1d/2d/3d on tiles; shares the wrapped conv's weight and bias (same state_dict keys)."""

    def __init__(self, conv: nn.modules.conv._ConvNd, grid: DomainGrid, overlap=False):
        nd = len(conv.kernel_size)
        if conv.transposed:
            raise ValueError("transposed convs are not domain-parallel here; use nn.Upsample + Conv")
        if conv.padding_mode not in ("zeros", "circular"):
            raise ValueError(f"padding_mode={conv.padding_mode!r} is not supported for domain "
                             "parallel; use 'zeros' or 'circular' (periodic grids)")
        pads = _resolve_padding(conv.padding, conv.kernel_size, conv.dilation, nd)
        geoms = [WindowGeometry(k, s, d, lo, hi) for k, s, d, (lo, hi)
                 in zip(conv.kernel_size, conv.stride, conv.dilation, pads)]
        super().__init__(grid, geoms, periodic=conv.padding_mode == "circular", overlap=overlap)
        self.weight = conv.weight
        self.bias = conv.bias
        self.stride, self.dilation, self.groups = conv.stride, conv.dilation, conv.groups
        self._fn = _CONV[nd]

    def _compute(self, inp, in_lo, out_lo, out_hi):
        return self._fn(inp, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class DomainPool(DomainWindowOp):
    """MaxPool/AvgPool 1d/2d/3d on tiles (floor mode; avg counts padding, torch's default)."""

    def __init__(self, pool: nn.Module, grid: DomainGrid, overlap=False):
        kind = "max" if "Max" in type(pool).__name__ else "avg"
        nd = int(type(pool).__name__[-2])
        if pool.ceil_mode:
            raise ValueError(f"{type(pool).__name__}(ceil_mode=True) is not supported for domain "
                             "parallel; use ceil_mode=False")
        if kind == "avg" and not pool.count_include_pad:
            raise ValueError("AvgPool(count_include_pad=False) is not supported for domain "
                             "parallel; use the default count_include_pad=True")
        k = _tuple(pool.kernel_size, nd)
        s = _tuple(pool.stride if pool.stride is not None else pool.kernel_size, nd)
        p = _tuple(pool.padding, nd)
        d = _tuple(getattr(pool, "dilation", 1), nd)
        geoms = [WindowGeometry(*a, pp, pp) for *a, pp in zip(k, s, d, p)]
        super().__init__(grid, geoms, fill=float("-inf") if kind == "max" else 0.0, overlap=overlap)
        self.kind, self.nd, self.k, self.s, self.d = kind, nd, k, s, d
        self.divisor_override = getattr(pool, "divisor_override", None)

    def _compute(self, inp, in_lo, out_lo, out_hi):
        if self.kind == "max":
            return _MAXPOOL[self.nd](inp, self.k, self.s, 0, self.d)
        if self.nd == 1:
            return F.avg_pool1d(inp, self.k, self.s, 0)
        return _AVGPOOL[self.nd](inp, self.k, self.s, 0, divisor_override=self.divisor_override)


class DomainUpsample(DomainWindowOp):
    """Nearest-neighbour upsampling by integer factors: out j reads in j // factor."""

    def __init__(self, up: nn.Upsample, grid: DomainGrid, overlap=False):
        if up.mode != "nearest" or up.scale_factor is None:
            raise ValueError(f"Upsample(mode={up.mode!r}, scale_factor={up.scale_factor!r}) is not "
                             "supported for domain parallel; use mode='nearest' (or 'bilinear' "
                             "with align_corners=False) with an integer scale_factor")
        f = _tuple(up.scale_factor, grid.ndim)
        if any(float(v) != int(v) or v < 1 for v in f):
            raise ValueError(f"Upsample scale_factor {up.scale_factor!r}: domain parallel needs "
                             "positive integer factors")
        self.factors = tuple(int(v) for v in f)
        super().__init__(grid, [WindowGeometry(up=v) for v in self.factors], overlap=overlap)

    def _compute(self, inp, in_lo, out_lo, out_hi):
        y = F.interpolate(inp, scale_factor=self.factors, mode="nearest")
        crop = tuple(slice(o - f * a, e - f * a) for o, e, f, a
                     in zip(out_lo, out_hi, self.factors, in_lo))
        return y[(Ellipsis,) + crop]


class DomainConvFn(DomainWindowOp):
    """``F.conv1d/2d/3d`` called in a forward: the geometry is fixed, the weights come per call."""

    def __init__(self, grid: DomainGrid, nd: int, kernel, stride, padding, dilation, groups,
                 overlap=False):
        stride, dilation = _tuple(stride, nd), _tuple(dilation, nd)
        pads = _resolve_padding(padding, kernel, dilation, nd)
        geoms = [WindowGeometry(k, s, d, lo, hi) for k, s, d, (lo, hi)
                 in zip(kernel, stride, dilation, pads)]
        super().__init__(grid, geoms, overlap=overlap)
        self.stride, self.dilation, self.groups = stride, dilation, groups
        self._fn, self._wb = _CONV[nd], (None, None)

    def forward(self, x, weight=None, bias=None):
        self._wb = (weight, bias)
        try:
            return super().forward(x)
        finally:
            self._wb = (None, None)  # hold no weights between calls

    def _compute(self, inp, in_lo, out_lo, out_hi):
        w, b = self._wb
        return self._fn(inp, w, b, self.stride, 0, self.dilation, self.groups)


class DomainLinearUp(DomainWindowOp):
    """(Bi/tri)linear upsampling by integer factors, align_corners=False: a halo of one point,
    the grid's edge points repeated beyond it (where torch clamps the source index)."""

    def __init__(self, grid: DomainGrid, factors, overlap=False):
        self.factors = tuple(int(f) for f in factors)
        super().__init__(grid, [LinearUpGeometry(up=f) for f in self.factors], overlap=overlap)
        self.mode = _LINEAR[grid.ndim]

    def _interp(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=self.factors, mode=self.mode, align_corners=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return self._interp(x)
        lay = self._layout(x)
        window = halo_exchange(x, lay.plan, self.grid.comm)  # boundary points filled with 0
        lead = window.dim() - self.grid.ndim
        for d, (lo, n) in enumerate(zip(lay.win_lo, lay.global_in)):
            dim, m = lead + d, window.shape[lead + d]
            if lo < 0:  # point -1 repeats point 0 (differentiably: its gradient goes there)
                window = torch.cat([window.narrow(dim, 1, 1), window.narrow(dim, 1, m - 1)], dim)
            if lo + m > n:  # point n repeats point n - 1
                window = torch.cat([window.narrow(dim, 0, m - 1), window.narrow(dim, m - 2, 1)],
                                   dim)
        crop = tuple(slice(o - f * a, e - f * a) for o, e, f, a
                     in zip(lay.out_lo, lay.out_hi, self.factors, lay.win_lo))
        return self._interp(window)[(Ellipsis,) + crop]


def domain_upsample(up: nn.Upsample, grid: DomainGrid, overlap=False) -> DomainWindowOp:
    """nn.Upsample on tiles: nearest, or (bi/tri)linear with align_corners=False."""
    if up.mode == _LINEAR.get(grid.ndim) and not up.align_corners and up.scale_factor is not None:
        f = _tuple(up.scale_factor, grid.ndim)
        if all(float(v) == int(v) and v >= 1 for v in f):
            return DomainLinearUp(grid, f, overlap)
    return DomainUpsample(up, grid, overlap)  # refuses any other mode
