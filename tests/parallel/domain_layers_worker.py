"""Under mpirun: every domain-parallel layer equals the unsharded torch layer on the full grid.

Forward outputs, input gradients and (summed) weight gradients, float64, over a table of
cases: kernels 1/3/5/7, strides 1/2, dilations 1/2, padding same/valid/explicit, odd grid
sizes, 1D/2D/3D, zero and periodic (circular) boundaries, pools, upsampling (nearest and
(bi/tri)linear), norms, with and without overlap; on every rank grid of this world size.
Also the halo exchange's adjoint.
"""

import copy
import warnings
import itertools
import sys

import torch
from torch import nn

from hpctrain.parallel.domain import DomainGrid, make_plan, to_domain
from hpctrain.parallel.domain.decomposition import WindowGeometry, rank_coords, split_bounds
from hpctrain.parallel.domain.halo import halo_exchange
from hpctrain.runtime.world import init_world
from tests.adjoint import check_adjoint

RTOL, ATOL = 1e-10, 1e-12
warnings.filterwarnings("ignore", message="Using padding=.same. with even kernel")
SIZES = {1: (37,), 2: (19, 17), 3: (15, 13, 11)}
GRIDS = {2: {1: [(2,)], 2: [(2, 1), (1, 2)], 3: [(1, 2, 1), (1, 1, 2)]},
         4: {1: [(4,)], 2: [(2, 2), (4, 1)], 3: [(2, 2, 1), (1, 2, 2)]}}
CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

# (kernel, stride, dilation, padding): every kernel meets every stride/dilation/padding kind.
CONV_CASES = [
    (1, 1, 1, 0), (1, 2, 1, 0), (1, 1, 1, "same"),
    (3, 1, 1, "same"), (3, 2, 1, 1), (3, 1, 2, "valid"), (3, 2, 2, 2), (3, 1, 1, "valid"),
    (5, 1, 1, "same"), (5, 2, 1, 2), (5, 1, 2, "same"), (5, 2, 2, "valid"), (5, 1, 1, 3),
    (7, 1, 1, "same"), (7, 2, 1, 3), (7, 1, 2, 6), (7, 2, 2, "valid"), (7, 1, 1, "valid"),
    (4, 1, 1, "same"),  # even kernel: torch's asymmetric 'same'
]


def tile(t, grid, glob):
    lo, hi = grid.tile(glob)
    return t[(Ellipsis,) + tuple(slice(a, b) for a, b in zip(lo, hi))]


def check(name, ref_layer, x_full, grid, comm, overlap):
    nd = grid.ndim
    ref_layer.zero_grad(set_to_none=True)
    mine = to_domain(copy.deepcopy(ref_layer), grid, comm, overlap=overlap)
    xr = x_full.clone().requires_grad_(True)
    yr = ref_layer(xr)
    g = torch.randn(yr.shape, dtype=yr.dtype, generator=torch.Generator().manual_seed(3))
    yr.backward(g)
    xs = tile(x_full, grid, x_full.shape[-nd:]).clone().requires_grad_(True)
    ys = mine(xs)
    ys.backward(tile(g, grid, yr.shape[-nd:]))
    where = f"{name} grid={grid.shape} overlap={overlap} rank={comm.rank}"
    try:
        torch.testing.assert_close(ys, tile(yr.detach(), grid, yr.shape[-nd:]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(xs.grad, tile(xr.grad, grid, x_full.shape[-nd:]), rtol=RTOL, atol=ATOL)
        for (pn, p), pr in zip(mine.named_parameters(), ref_layer.parameters()):
            torch.testing.assert_close(comm.allreduce(p.grad.clone()), pr.grad, rtol=RTOL, atol=ATOL)
        for (bn, b), br in zip(mine.named_buffers(), ref_layer.buffers()):
            torch.testing.assert_close(b, br, rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from None


def main():
    world = init_world()
    comm = world.comm
    n = comm.size
    count = 0
    gen = torch.Generator().manual_seed(0)
    for nd in (1, 2, 3):
        size = SIZES[nd]
        x = torch.randn((2, 3) + size, dtype=torch.float64, generator=gen)
        for shape in GRIDS[n][nd]:
            grid = DomainGrid(comm, shape)
            # Halo exchange is a linear operator: its backward is its adjoint.
            geoms = [WindowGeometry(5, 1, 1, 2, 2)] * nd
            for periodic in (False, True):
                b = [split_bounds(m, p) for m, p in zip(size, shape)]
                boxes = []
                for q in range(n):
                    c = rank_coords(q, shape)
                    w = [g.window(*b[d][c[d]]) for d, g in enumerate(geoms)]
                    boxes.append((tuple(a for a, _ in w), tuple(e for _, e in w)))
                plan = make_plan(grid, size, boxes, (periodic,) * nd)
                lo, hi = grid.tile(size)
                local = (2, 3) + tuple(e - a for a, e in zip(lo, hi))
                check_adjoint(lambda t: halo_exchange(t, plan, comm), local,
                              (2, 3) + plan.window_shape, comm)
            cases = CONV_CASES if nd < 3 else [c for c in CONV_CASES if c[0] * c[2] <= 7]
            for (k, s, d, p), mode in itertools.product(cases, ("zeros", "circular")):
                if mode == "circular" and p == "valid":
                    continue
                torch.manual_seed(k * 100 + s * 10 + d)
                conv = CONV[nd](3, 4, k, stride=s, dilation=d, padding=p, padding_mode=mode,
                                groups=1 if k != 5 else 1).double()
                for overlap in (False, True):
                    check(f"conv{nd}d k={k} s={s} d={d} p={p} {mode}", conv, x, grid, comm, overlap)
                    count += 1
            pools = [nn.MaxPool1d(3, 2, 1), nn.AvgPool1d(2), nn.MaxPool1d(2, dilation=2)]
            if nd == 2:
                pools = [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(2), nn.MaxPool2d(2),
                         nn.AvgPool2d(3, 1, 1), nn.MaxPool2d(3, 1, 1, dilation=1)]
            if nd == 3:
                pools = [nn.MaxPool3d(3, 2, 1), nn.AvgPool3d(2)]
            linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[nd]
            others = pools + [nn.Upsample(scale_factor=2), nn.Upsample(scale_factor=3),
                              nn.Upsample(scale_factor=2, mode=linear),
                              nn.GroupNorm(1, 3).double(), nn.GroupNorm(3, 3).double(),
                              nn.Sequential(CONV[nd](3, 6, 3, padding=1), nn.GroupNorm(2, 6),
                                            nn.ReLU()).double()]
            if nd == 2:
                others.append(nn.BatchNorm2d(3).double())
            for layer in others:
                for overlap in (False, True):
                    check(repr(layer).replace("\n", " "), layer, x, grid, comm, overlap)
                    count += 1
    # Bad input: a grid too small for the ranks fails with one clear error.
    if n == 4:
        grid = DomainGrid(comm, (4,))
        bad = to_domain(nn.Conv1d(1, 1, 7), grid, comm)
        try:
            bad(torch.zeros(1, 1, 2, dtype=torch.float32))
        except ValueError as e:
            assert "fewer points than the rank grid" in str(e), e
        else:
            raise AssertionError("a 9-point 1D grid over 4 ranks with a 7-wide valid conv must fail")
    comm.barrier()
    if comm.rank == 0:
        print(f"domain layers ok: {count} cases on {n} ranks")
    sys.stdout.flush()


main()
