"""Pure arithmetic of a Cartesian domain decomposition (no MPI, no torch).

Conventions shared by every domain-parallel piece:
- a grid dimension of n points over p ranks is split like ``torch.tensor_split``: the first
  ``n % p`` ranks own one point more (uneven splits are normal);
- ranks are numbered row-major over the rank grid (last grid dimension fastest);
- a layer's OUTPUT is again split that way over its global size, so every tensor in a
  domain-parallel model is the balanced split of its global grid;
- output index j of a window op (kernel k, stride s, dilation d, left padding p) reads
  input [s*j - p, s*j - p + d*(k-1)] (ANCHORS.md); indices outside [0, n) are boundary:
  zeros (or a fill value) or, for periodic grids, wrapped around.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["split_bounds", "rank_coords", "coords_rank", "grid_shape_for", "conv_out_size",
           "Segment", "dim_segments", "Piece", "window_pieces", "wrap_mirrors", "WindowGeometry",
           "LinearUpGeometry"]


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` balanced pieces of n points (first n % parts get +1)."""
    if parts < 1 or n < 0:
        raise ValueError(f"cannot split {n} points over {parts} ranks")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for q in range(parts):
        stop = start + base + (q < extra)
        out.append((start, stop))
        start = stop
    return out


def rank_coords(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinates of `rank` in a grid of ranks of `shape`."""
    coords = []
    for extent in reversed(shape):
        coords.append(rank % extent)
        rank //= extent
    return tuple(reversed(coords))


def coords_rank(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Row-major rank of `coords` in a grid of ranks of `shape`."""
    rank = 0
    for c, extent in zip(coords, shape):
        rank = rank * extent + c
    return rank


def grid_shape_for(dom: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """The rank grid over `ndim` spatial dims: `dom` padded with 1s (dom=4 on 2D -> 4x1)."""
    dom = tuple(int(v) for v in dom)
    if len(dom) > ndim:
        if all(v == 1 for v in dom[ndim:]):
            return dom[:ndim]
        raise ValueError(f"dom={'x'.join(map(str, dom))} has {len(dom)} grid dimensions but the "
                         f"data has {ndim} spatial dimensions; use at most {ndim}, e.g. dom=2x2")
    return dom + (1,) * (ndim - len(dom))


def conv_out_size(n: int, kernel: int, stride: int, dilation: int, pad_lo: int, pad_hi: int) -> int:
    """Output length of a window op over n input points (floor mode, as torch)."""
    return (n + pad_lo + pad_hi - dilation * (kernel - 1) - 1) // stride + 1


@dataclass(frozen=True)
class Segment:
    """A run of a window along one dim: window[dst:dst+len] = owner q's local [src:src+len].

    ``owner`` is None for boundary points outside a non-periodic grid (filled, not sent).
    """

    owner: int | None
    src: int
    dst: int
    length: int


def dim_segments(lo: int, hi: int, bounds: list[tuple[int, int]], periodic: bool) -> list[Segment]:
    """Cut the global index range [lo, hi) into runs owned by one rank (or boundary) each."""
    n = bounds[-1][1]
    out, pos = [], lo
    while pos < hi:
        if not periodic and (pos < 0 or pos >= n):
            end = min(hi, 0) if pos < 0 else hi
            out.append(Segment(None, 0, pos - lo, end - pos))
            pos = end
            continue
        g = pos % n if periodic else pos
        q = next(i for i, (a, b) in enumerate(bounds) if a <= g < b)
        run = min(hi - pos, bounds[q][1] - g)
        out.append(Segment(q, g - bounds[q][0], pos - lo, run))
        pos += run
    return out


@dataclass(frozen=True)
class Piece:
    """A box of a rank's window: filled (owner None) or copied from owner's local box."""

    owner: int | None  # rank in the domain group, or None for a boundary fill
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def window_pieces(lo: tuple[int, ...], hi: tuple[int, ...], bounds: list[list[tuple[int, int]]],
                  grid: tuple[int, ...], periodic: tuple[bool, ...],
                  mirrored: tuple[bool, ...] | None = None) -> list[Piece]:
    """Pieces of the global box [lo, hi): products of the per-dim runs (corners included).

    Along a ``mirrored`` dim (see ``wrap_mirrors``) only the runs inside the grid are cut:
    its wrapped runs are copies of the window itself, made after the pieces have arrived.
    """
    per_dim = []
    for d, (a, b, bd, p) in enumerate(zip(lo, hi, bounds, periodic)):
        runs = dim_segments(a, b, bd, p)
        if mirrored is not None and mirrored[d]:
            runs = [s for s in runs if 0 <= a + s.dst < bd[-1][1]]
        per_dim.append(runs)
    pieces = []
    for combo in itertools.product(*per_dim):
        dst = tuple(slice(s.dst, s.dst + s.length) for s in combo)
        if any(s.owner is None for s in combo):
            pieces.append(Piece(None, (), dst))
            continue
        src = tuple(slice(s.src, s.src + s.length) for s in combo)
        pieces.append(Piece(coords_rank(tuple(s.owner for s in combo), grid), src, dst))
    return pieces


def wrap_mirrors(lo: tuple[int, ...], hi: tuple[int, ...], bounds: list[list[tuple[int, int]]],
                 grid: tuple[int, ...], periodic: tuple[bool, ...]):
    """Periodic dims that one rank spans, whose wrapped window runs copy the window's own core.

    Returns (mirrored flag per dim, [(dim, dst run, src run)] as window-local (start, stop)).
    Along such a dim the neighbour's rows arrive once, over the core only, and the wrapped
    columns (corners included) are copied locally afterwards, as stencil codes do: fewer,
    longer blocks per message than sending each corner as its own piece.
    """
    flags, mirrors = [], []
    for d, (a, b, bd, p, g) in enumerate(zip(lo, hi, bounds, periodic, grid)):
        n = bd[-1][1]
        runs, ok = [], p and g == 1 and (a < 0 or b > n)
        c0, c1 = max(a, 0), min(b, n)  # the window's core: global points it holds unwrapped
        for s in dim_segments(a, b, bd, p) if ok else ():
            if 0 <= a + s.dst < n:
                continue
            if not (c0 <= s.src and s.src + s.length <= c1):
                ok = False  # the wrapped points are not in the window: send them
                break
            runs.append((d, (s.dst, s.dst + s.length), (s.src - a, s.src - a + s.length)))
        flags.append(bool(ok))
        if ok:
            mirrors += runs
    return tuple(flags), mirrors


@dataclass(frozen=True)
class WindowGeometry:
    """One spatial dim of a window op: out j reads in [stride*j - pad_lo, ... + span - 1].

    ``span`` = dilation*(kernel-1)+1 for convs and pools; ``up`` > 1 is nearest upsampling
    (out j reads in j // up).
    """

    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    up: int = 1

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        if self.up > 1:
            return n * self.up
        return conv_out_size(n, self.kernel, self.stride, self.dilation, self.pad_lo, self.pad_hi)

    def window(self, o0: int, o1: int) -> tuple[int, int]:
        """Global input range [lo, hi) that outputs [o0, o1) read (o1 > o0)."""
        if self.up > 1:
            return o0 // self.up, (o1 - 1) // self.up + 1
        return self.stride * o0 - self.pad_lo, self.stride * (o1 - 1) - self.pad_lo + self.span

    def interior(self, o0: int, o1: int, i0: int, i1: int) -> tuple[int, int]:
        """Outputs in [o0, o1) whose inputs all lie in the local tile [i0, i1) (maybe empty)."""
        if self.up > 1:
            a, b = i0 * self.up, i1 * self.up
        else:  # first j with s*j - pad_lo >= i0, last with s*j - pad_lo + span <= i1
            a = -(-(i0 + self.pad_lo) // self.stride)
            b = (i1 - self.span + self.pad_lo) // self.stride + 1
        a, b = max(a, o0), min(b, o1)
        return (a, b) if a < b else (o0, o0)


@dataclass(frozen=True)
class LinearUpGeometry(WindowGeometry):
    """Linear upsampling by an integer ``up`` (align_corners=False): out j reads in i and i+1,
    i = floor((j + 0.5) / up - 0.5) (i = -1 and i + 1 = n are the edge points repeated)."""

    def out_size(self, n: int) -> int:
        return n * self.up

    def window(self, o0: int, o1: int) -> tuple[int, int]:
        first = (2 * o0 + 1 - self.up) // (2 * self.up)  # exact integer floor
        return first, (2 * (o1 - 1) + 1 - self.up) // (2 * self.up) + 2

    def interior(self, o0: int, o1: int, i0: int, i1: int) -> tuple[int, int]:
        return o0, o0  # no overlap: the op is cheap next to its halo
