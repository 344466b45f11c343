"""Under mpirun: conv nets whose forward calls functions across grid points, split over tiles.

Every SUPPORTED model of tests/fixtures/domain_functional.py (global mean/max gates, functional
max/avg pooling and conv, nearest interpolation, adaptive pooling, flatten + mean), float64,
on every rank grid of this world size (and, at 4 ranks, the 3-rank grids of a subgroup),
with and without overlap (2x1, 2x2): outputs, input gradients and summed weight gradients
equal one process on the whole grid. The grid reductions' backward is their adjoint. Every
REFUSED model raises one ValueError naming its op and line, on every rank, in the forward.
"""

import copy
import sys

import torch

from hpctrain.parallel.domain import DomainGrid, to_domain
from hpctrain.parallel.domain.functional import DomainFunctions, check
from hpctrain.runtime.world import init_world
from tests.adjoint import check_adjoint
from tests.fixtures import domain_functional as D

RTOL, ATOL = 1e-10, 1e-12
GRIDS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (2, 2), (1, 4)]}


def tile(t, grid, glob):
    lo, hi = grid.tile(glob)
    return t[(Ellipsis,) + tuple(slice(a, b) for a, b in zip(lo, hi))]


def forward(model, fn, grid, x, key):
    grid.begin((key, tuple(x.shape)))  # the cached global shapes are this model's
    try:
        with fn:
            return model(fn.split(x))
    finally:
        grid.end()


def check_case(name, grid, comm, overlap, x_full):
    ref, _, _ = D.build(name)
    ref = ref.double()
    check(ref, x_full)  # the one-process check passes it
    mine = to_domain(copy.deepcopy(ref), grid, comm, overlap=overlap)
    fn = DomainFunctions(2, grid, overlap)
    fn.watch(mine, check=False)
    xr = x_full.clone().requires_grad_(True)
    yr = ref(xr)
    g = torch.randn(yr.shape, dtype=yr.dtype, generator=torch.Generator().manual_seed(3))
    yr.backward(g)
    xs = tile(x_full, grid, x_full.shape[-2:]).clone().requires_grad_(True)
    for _ in range(2):  # the second call reuses the cached layouts and window ops
        ys = forward(mine, fn, grid, xs, (name, overlap))
    ys.backward(tile(g, grid, yr.shape[-2:]))
    where = f"{name} grid={grid.shape} overlap={overlap} rank={comm.rank}"
    try:
        torch.testing.assert_close(ys, tile(yr.detach(), grid, yr.shape[-2:]), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(xs.grad, tile(xr.grad, grid, x_full.shape[-2:]), rtol=RTOL,
                                   atol=ATOL)
        for (pn, p), pr in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(comm.allreduce(p.grad.clone()), pr.grad, rtol=RTOL,
                                       atol=ATOL, msg=lambda m: f"{pn}: {m}")
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from None


def check_refused(name, grid, comm, x_full):
    op, _ = D.REFUSED[name]
    model, _, _ = D.build(name)
    model = to_domain(model.double(), grid, comm)
    fn = DomainFunctions(2, grid)
    fn.watch(model, check=False)
    try:
        forward(model, fn, grid, tile(x_full, grid, x_full.shape[-2:]), name)
    except ValueError as e:
        msg = str(e)
        assert f"cannot split {op}" in msg and "domain_functional.py:" in msg \
            and "# refused" in msg and "\n" not in msg, msg
        return
    raise AssertionError(f"{name}: not refused on the tiles of {grid.shape}")


def check_adjoints(grid, comm):
    """<F x, y> = <x, F* y> over the ranks for every grid reduction (amax: its Jacobian)."""
    lo, hi = grid.tile((11, 9))
    local = (2, 3) + tuple(b - a for a, b in zip(lo, hi))
    ops = {"sum": (lambda u: u.sum((2, 3)), (2, 3)),
           "mean-keepdim": (lambda u: u.mean((-1, -2), keepdim=True), (2, 3, 1, 1)),
           "mean-all": (lambda u: u.mean(), ()),
           "flat-mean": (lambda u: u.flatten(2).mean(-1), (2, 3)),
           "amax": (lambda u: u.amax((2, 3)), (2, 3)),
           "max": (lambda u: u.max(), ()),
           "adaptive": (lambda u: torch.nn.functional.adaptive_avg_pool2d(u, 1), (2, 3, 1, 1))}
    for name, (op, out_shape) in ops.items():
        fn = DomainFunctions(2, grid)

        def f(x, op=op, fn=fn):
            with fn:
                return op(fn.split(x))
        check_adjoint(f, local, out_shape, comm)


def main():
    world = init_world()
    comm = world.comm
    n = comm.size
    x = torch.randn(2, 1, D.H, D.W, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    grids = [(comm, s) for s in GRIDS[n]]
    if n == 4:  # dom=3 on three of the four ranks
        sub = comm.split(0 if comm.rank < 3 else None)
        if comm.rank < 3:
            grids += [(sub, (3, 1)), (sub, (1, 3))]
    count = 0
    for c, shape in grids:
        grid = DomainGrid(c, shape)
        check_adjoints(grid, c)
        overlaps = (False, True) if shape in ((2, 1), (2, 2)) else (False,)  # keep it short
        for name in D.SUPPORTED:
            for overlap in overlaps:
                check_case(name, grid, c, overlap, x)
                count += 1
        for name in D.REFUSED:
            check_refused(name, grid, c, x)
            count += 1
    comm.barrier()
    if comm.rank == 0:
        print(f"domain functional ok: {count} cases on {n} ranks")
    sys.stdout.flush()


main()
