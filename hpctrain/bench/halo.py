"""Halo exchange vs raw MPI Sendrecv, and the U-Net step time at N ranks vs 1 (same grid).

Run under mpirun (``mpirun -n 2 python -m hpctrain bench halo``). The raw baseline uses
mpi4py directly (the toolkit's strategies never do): each rank Sendrecv's buffers of the same
bytes with the same neighbours. Rank 0 prints medians; the machine's load average is shown
because shared machines make these numbers noisy.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time

import torch
import torch.nn.functional as F

__all__ = ["run"]


def _medians_s(fns, reps: int, comm) -> list[float]:
    """Median time of each fn, run round-robin (one of each per round) so drift in the
    machine's load hits all alike; the slowest rank sets the pace of a bulk-synchronous code."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [comm.allreduce(statistics.median(ts), op=_max()) for ts in times]


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _exchange_bench(world, batch, channels, height, size, reps, tile_copy=True) -> dict:
    """Median times (s) of one periodic 3x3 halo exchange of a batch x channels x height x size
    field split over a (ranks x 1) grid, and of the raw mpi4py baselines of the same bytes."""
    from mpi4py import MPI

    from hpctrain.parallel.domain.decomposition import WindowGeometry, rank_coords
    from hpctrain.parallel.domain.halo import DomainGrid, halo_exchange, make_plan, start_halo

    comm, mpi = world.comm, world.mpi_comm
    grid = DomainGrid(comm, (comm.size, 1))
    glob = (height, size)
    geoms = [WindowGeometry(3, 1, 1, 1, 1)] * 2  # a 3x3 'same' conv: one halo row each side
    out_b = grid.bounds(glob)
    boxes = []
    for q in range(comm.size):
        c = rank_coords(q, grid.shape)
        w = [g.window(*out_b[d][c[d]]) for d, g in enumerate(geoms)]
        boxes.append((tuple(a for a, _ in w), tuple(b for _, b in w)))
    plan = make_plan(grid, glob, boxes, (True, True))  # periodic: two neighbours per rank
    lo, hi = grid.tile(glob)
    # requires_grad: time the training path (the autograd Function that records the adjoint).
    x = torch.randn((batch, channels) + tuple(b - a for a, b in zip(lo, hi)), requires_grad=True)
    # Messages only: no copy of the tile itself, no wrap copies within the window.
    comm_only = dataclasses.replace(plan, local=[], fills=[], mirrors=[])
    # Raw baselines, the same bytes (one halo row from each neighbour of the periodic 1D rank
    # grid) as two shifts of blocking Sendrecv: (1) prepacked contiguous buffers, the wire
    # floor; (2) what a hand-written mpi4py halo exchange does: subarray datatypes straight
    # from the field's boundary rows into the padded window's halo rows (no Python copies).
    r, n = comm.rank, comm.size
    up, down = (r + 1) % n, (r - 1) % n
    row = batch * channels * size
    s1, s2, r1, r2 = (torch.randn(row).numpy() for _ in range(4))

    def raw():
        mpi.Sendrecv([s1, MPI.FLOAT], dest=up, recvbuf=[r1, MPI.FLOAT], source=down)
        mpi.Sendrecv([s2, MPI.FLOAT], dest=down, recvbuf=[r2, MPI.FLOAT], source=up)
    xa = x.detach().numpy()
    win = torch.zeros((batch, channels) + plan.window_shape).numpy()
    rows = xa.shape[2]

    def rowtype(shape, at, col):
        t = MPI.FLOAT.Create_subarray(list(shape), [batch, channels, 1, size], [0, 0, at, col])
        t.Commit()
        return t
    first, last = rowtype(xa.shape, 0, 0), rowtype(xa.shape, rows - 1, 0)
    top, bottom = rowtype(win.shape, 0, 1), rowtype(win.shape, rows + 1, 1)

    def raw_inplace():
        mpi.Sendrecv([xa, 1, last], dest=up, recvbuf=[win, 1, top], source=down)
        mpi.Sendrecv([xa, 1, first], dest=down, recvbuf=[win, 1, bottom], source=up)
    # The message-only variants interleave; the tile copy (MBs, it flushes the caches) runs
    # on its own afterwards.
    xd = x.detach()
    t_comm, t_plain, t_raw, t_inplace = _medians_s(
        [lambda: halo_exchange(x, comm_only, comm),
         lambda: start_halo(xd, comm_only, comm).finish(), raw, raw_inplace], reps, mpi)
    t_full = None
    if tile_copy:
        t_full, = _medians_s([lambda: halo_exchange(x, plan, comm)], max(5, reps // 10), mpi)
    for t in (first, last, top, bottom):
        t.Free()
    return {"full": t_full, "comm": t_comm, "plain": t_plain, "raw": t_raw, "inplace": t_inplace,
            "bytes": r1.nbytes + r2.nbytes, "field": (batch, channels, height, size), "reps": reps}


def _print_exchange(r) -> None:
    b, c, height, size = r["field"]
    print(f"  exchange of a {b}x{c}x{height}x{size} fp32 field, 3x3 periodic halo, "
          f"{r['bytes'] / 1024:.0f} KiB received per rank, median of {r['reps']}:")
    print(f"    raw mpi4py Sendrecv, packed buffers    {r['raw'] * 1e6:9.1f} us   (wire floor: halo "
          "rows already contiguous)")
    print(f"    raw mpi4py Sendrecv, subarray in place {r['inplace'] * 1e6:9.1f} us   (boundary rows "
          "of the field -> halo rows of the window)")
    print(f"    halo exchange (messages)               {r['comm'] * 1e6:9.1f} us   ratio "
          f"{r['comm'] / r['inplace']:.2f}x in place (target <= 1.2), "
          f"{r['comm'] / r['raw']:.2f}x packed")
    print(f"      of which outside autograd          {r['plain'] * 1e6:9.1f} us   ratio "
          f"{r['plain'] / r['inplace']:.2f}x in place (the same messages, no autograd node)")
    if r["full"] is not None:
        print(f"    halo exchange (+tile copy)             {r['full'] * 1e6:9.1f} us   (also copies "
              "the tile into its padded window, as a conv layer needs)")




def _domain_step(world, model, x, y, overlap, dom):
    """One training step of the U-Net split over ``dom`` ranks (a closure; collective): the
    domain plan through the orchestrator, as the trainer builds it."""
    from hpctrain.parallel.domain.executor import DomainOptions
    from hpctrain.parallel.orchestrator import apply_plan
    from hpctrain.parallel.plan import build_plan
    from hpctrain.train.precision import Precision

    plan = build_plan("domain", f"dom={dom}", world.size)
    par = apply_plan(plan, copy.deepcopy(model), lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                      world, {"domain": DomainOptions(overlap=overlap)})
    executor = par.executor
    glob = tuple(x.shape[-2:])
    xs, ys = executor.crop(x, glob), executor.crop(y, glob)
    executor.set_global_shapes(glob, glob)
    prec = Precision("fp32", torch.device("cpu"))

    def step():
        par.forward_backward([(xs, ys, 1.0)], F.mse_loss, prec)
        par.step()
    return step


def _single_step(model, x, y):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _step_times(world, model, x, y, steps, warmup):
    """Median step time of: 1 rank (rank 0 alone), N ranks with overlap, N ranks without.

    The three run round by round (one step of each per round) so that a change in the
    machine's load hits them alike; the others wait without spinning while rank 0 runs
    alone.
    """
    mpi = world.mpi_comm
    single = _single_step(model, x, y) if world.rank == 0 else None
    ov = _domain_step(world, model, x, y, True, world.size)
    no = _domain_step(world, model, x, y, False, world.size)
    t1, tov, tno = [], [], []
    for i in range(warmup + steps):
        if world.rank == 0:
            t = _timed(single)
            mpi.Ibarrier().Wait()
        else:
            t = None
            _idle_wait(mpi)
        mpi.Barrier()
        a = _timed(ov)
        mpi.Barrier()
        b = _timed(no)
        if i >= warmup:
            t1.append(t)
            tov.append(mpi.allreduce(a, op=_max()))
            tno.append(mpi.allreduce(b, op=_max()))
    return (statistics.median(t1) if world.rank == 0 else None,
            statistics.median(tov), statistics.median(tno))


def _idle_wait(mpi):
    """Wait for rank 0 without spinning (a blocking MPI wait would steal its core)."""
    req = mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.01)


def run(size=512, channels=32, batch=2, reps=50, model_size=256, base=16, steps=5, warmup=2,
        wide=4096) -> int:
    from hpctrain.models.unet import UNet
    from hpctrain.runtime.world import init_world

    world = init_world(device="cpu")
    mpi, n = world.mpi_comm, world.size
    exchanges = [_exchange_bench(world, batch, channels, size, size, reps)]
    if wide:  # wide rows, few of them: 8x (at 4096) the halo bytes in little memory
        exchanges.append(_exchange_bench(world, 1, 64, 8 * n, wide, reps, tile_copy=False))
    torch.manual_seed(0)
    model = UNet(1, base, 2, "group", True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 1, model_size, model_size, generator=g)
    y = torch.randn(batch, 1, model_size, model_size, generator=g)
    t1, t_ov, t_no = _step_times(world, model, x, y, steps, warmup)
    if world.rank == 0:
        print(f"halo bench: {n} ranks (grid {n}x1), load average {os.getloadavg()[0]:.2f} "
              f"(shared machine: numbers are noisy)")
        for r in exchanges:
            _print_exchange(r)
        tile = -(-model_size // n)
        print(f"  U-Net step (base {base}, {batch}x1x{model_size}x{model_size}, AdamW; tiles of "
              f"{tile}x{model_size}), median of {steps} rounds after {warmup}:")
        print(f"    1 rank, full grid        {t1 * 1e3:9.1f} ms")
        print(f"    {n} ranks, overlap        {t_ov * 1e3:9.1f} ms   ratio {t_ov / t1:.2f}x (target <= 0.6)")
        print(f"    {n} ranks, no overlap     {t_no * 1e3:9.1f} ms   ratio {t_no / t1:.2f}x")
        print(f"  overlap gain: {(t_no - t_ov) / t_no * 100:+.1f}% of the step")
    mpi.Barrier()
    return 0
