"""Pure decomposition arithmetic (no MPI): splits, rank grids, windows, pieces, interiors."""

import itertools

import pytest

from hpctrain.parallel.domain.decomposition import (WindowGeometry, conv_out_size, coords_rank,
                                                    dim_segments, grid_shape_for, rank_coords,
                                                    split_bounds, window_pieces, wrap_mirrors)


@pytest.mark.parametrize("n, p", [(10, 3), (7, 7), (37, 4), (5, 2), (16, 4)])
def test_split_bounds_matches_tensor_split(n, p):
    import torch

    ref = [len(c) for c in torch.tensor_split(torch.arange(n), p)]
    b = split_bounds(n, p)
    assert [e - a for a, e in b] == ref
    assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(p - 1))


def test_rank_coords_roundtrip_row_major():
    shape = (2, 3, 2)
    coords = [rank_coords(r, shape) for r in range(12)]
    assert coords[1] == (0, 0, 1) and coords[2] == (0, 1, 0) and coords[6] == (1, 0, 0)
    assert [coords_rank(c, shape) for c in coords] == list(range(12))


def test_grid_shape_pads_and_rejects():
    assert grid_shape_for((4,), 2) == (4, 1)
    assert grid_shape_for((2, 2), 3) == (2, 2, 1)
    assert grid_shape_for((2, 1, 1), 2) == (2, 1)
    with pytest.raises(ValueError, match="at most 2"):
        grid_shape_for((2, 2, 2), 2)


@pytest.mark.parametrize("k, s, d, p", list(itertools.product((1, 3, 5, 7), (1, 2), (1, 2), (0, 1, 3))))
def test_window_is_the_receptive_field(k, s, d, p):
    g = WindowGeometry(k, s, d, p, p)
    n = 23
    m = g.out_size(n)
    assert m == conv_out_size(n, k, s, d, p, p)
    for j in range(m):  # ANCHORS: output j reads [s*j - p, s*j - p + d(k-1)]
        assert g.window(j, j + 1) == (s * j - p, s * j - p + d * (k - 1) + 1)
    # Interior outputs of a tile read only that tile; the ones just outside do not.
    i0, i1 = 7, 15
    a, b = g.interior(0, m, i0, i1)
    for j in range(m):
        lo, hi = g.window(j, j + 1)
        assert (a <= j < b) == (lo >= i0 and hi <= i1)


def test_upsample_window():
    g = WindowGeometry(up=3)
    assert g.out_size(5) == 15
    assert g.window(4, 10) == (1, 4)
    assert g.interior(0, 15, 2, 4) == (6, 12)


def test_dim_segments_zero_and_periodic():
    bounds = split_bounds(10, 3)  # (0,4) (4,7) (7,10)
    segs = dim_segments(-2, 6, bounds, periodic=False)
    assert [(s.owner, s.src, s.dst, s.length) for s in segs] == [
        (None, 0, 0, 2), (0, 0, 2, 4), (1, 0, 6, 2)]
    segs = dim_segments(-2, 12, bounds, periodic=True)
    assert [(s.owner, s.src, s.dst, s.length) for s in segs] == [
        (2, 1, 0, 2), (0, 0, 2, 4), (1, 0, 6, 3), (2, 0, 9, 3), (0, 0, 12, 2)]
    # A halo wider than a neighbour's tile reaches past it (non-neighbour owners).
    segs = dim_segments(3, 9, bounds, periodic=False)
    assert [s.owner for s in segs] == [0, 1, 2]


def test_window_pieces_include_corners():
    bounds = [split_bounds(6, 2), split_bounds(6, 2)]
    # Rank (0,0) owns [0,3)x[0,3); its 1-wide halo box touches right, below and the corner.
    pieces = window_pieces((-1, -1), (4, 4), bounds, (2, 2), (False, False))
    owners = sorted({p.owner for p in pieces if p.owner is not None})
    assert owners == [0, 1, 2, 3]
    corner = [p for p in pieces if p.owner == 3]
    assert corner[0].src == (slice(0, 1), slice(0, 1)) and corner[0].dst == (slice(4, 5), slice(4, 5))
    covered = sum((p.dst[0].stop - p.dst[0].start) * (p.dst[1].stop - p.dst[1].start) for p in pieces)
    assert covered == 25


def test_wrap_mirrors_copy_the_window_core_of_dims_one_rank_spans():
    bounds = [split_bounds(8, 2), split_bounds(10, 1)]
    # A 1-wide periodic halo on a 2x1 rank grid: dim 1 (one rank) wraps onto the window itself.
    flags, mirrors = wrap_mirrors((-1, -1), (5, 11), bounds, (2, 1), (True, True))
    assert flags == (False, True)
    assert mirrors == [(1, (0, 1), (10, 11)), (1, (11, 12), (1, 2))]
    # Only the core runs of the mirrored dim are pieces; the corners come from the mirrors.
    pieces = window_pieces((-1, -1), (5, 11), bounds, (2, 1), (True, True), flags)
    assert {(p.dst[1].start, p.dst[1].stop) for p in pieces} == {(1, 11)}
    assert sorted({p.owner for p in pieces}) == [0, 1]
    # Not periodic, or more than one rank along the dim, or wrapped points the window does
    # not hold (a 2-wide halo of a 3-point window): no mirrors.
    assert wrap_mirrors((-1, -1), (5, 11), bounds, (2, 1), (False, False)) == ((False, False), [])
    assert wrap_mirrors((-2,), (1,), [split_bounds(10, 1)], (1,), (True,)) == ((False,), [])
    assert wrap_mirrors((-1,), (9,), [split_bounds(8, 1)], (1,), (True,)) == (
        (True,), [(0, (0, 1), (8, 9)), (0, (9, 10), (1, 2))])


def test_window_buffer_is_reused_only_when_free():
    """A window is reused across calls, never while a tensor (or autograd) still holds it."""
    import torch

    from hpctrain.parallel.domain.halo import HaloPlan

    plan = HaloPlan((4, 5), fills=[(slice(0, 1), slice(0, 5))], fill=-1.0)
    x = torch.zeros(2, 3, 3)
    w1 = plan.window_buffer((2,), x)
    assert w1.shape == (2, 4, 5) and bool((w1[:, 0] == -1).all())   # fills written once
    w2 = plan.window_buffer((2,), x)                                  # w1 alive: a new buffer
    assert w2.data_ptr() != w1.data_ptr()
    ptr = w2.data_ptr()
    weight = torch.ones(5, requires_grad=True)
    y = (w2 * weight).sum()                                           # autograd saves w2
    del w2
    assert plan.window_buffer((2,), x).data_ptr() != ptr              # still saved for backward
    w3 = plan.window_buffer((2,), x)
    ptr3 = w3.data_ptr()
    y.backward()
    del w3, y
    assert plan.window_buffer((2,), x).data_ptr() == ptr3             # free again: reused
    assert plan.window_buffer((2,), x.double()).dtype == torch.float64  # one cache per dtype
