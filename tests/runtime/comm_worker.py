"""Run under mpirun: check every Communicator op against values computed locally.

Usage: ``python tests/runtime/comm_worker.py BACKEND...`` (mpi, gloo: each in turn, one
process start). Raises (exit code != 0) on any mismatch; rank 0 prints ``comm_worker OK``
at the end of each backend.
"""

import sys

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.runtime.comm import NullCommunicator, TorchDistCommunicator, wait_all, world
from hpctrain.runtime.comm.mpi import _as_buffer

__all__ = ["check_all", "main"]

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPES = FLOATS + (torch.int64, torch.int32, torch.int8, torch.uint8)


def expect(got, want, what):
    """Raise AssertionError unless tensors (or lists) are equal."""
    if isinstance(got, torch.Tensor):
        ok = got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    else:
        ok = got == want
    if not ok:
        raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def expect_raises(exc, fragment, fn, what):
    try:
        fn()
    except exc as err:
        if fragment not in str(err):
            raise AssertionError(f"{what}: message {str(err)!r} lacks {fragment!r}") from err
        return
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def check_reductions(comm):
    r, n = comm.rank, comm.size
    total = n * (n + 1) // 2                      # sum over ranks of (rank + 1)
    for dt in DTYPES:
        t = torch.full((2, 3), r + 1, dtype=dt)
        expect(comm.allreduce(t), torch.full((2, 3), total, dtype=dt), f"allreduce sum {dt}")
        t = torch.full((5,), r + 1, dtype=dt)
        expect(comm.allreduce(t, op="max"), torch.full((5,), n, dtype=dt), f"max {dt}")
        t = torch.full((5,), r + 1, dtype=dt)
        expect(comm.allreduce(t, op="min"), torch.full((5,), 1, dtype=dt), f"min {dt}")
    for dt in FLOATS:
        t = torch.full((4,), float(2 * r), dtype=dt)
        expect(comm.allreduce(t, op="avg"), torch.full((4,), float(n - 1), dtype=dt), f"avg {dt}")
    for dt in (torch.float64, torch.int64):
        t = torch.full((3,), 2, dtype=dt)
        expect(comm.allreduce(t, op="prod"), torch.full((3,), 2 ** n, dtype=dt), f"prod {dt}")
    flags = torch.tensor([r == 0, True, False])
    expect(comm.allreduce(flags.clone(), op="max"), torch.tensor([True, True, False]), "bool or")
    expect(comm.allreduce(flags.clone(), op="min"), torch.tensor([n == 1, True, False]),
           "bool and")
    expect(comm.allreduce(torch.tensor(float(r))), torch.tensor(float(n * (n - 1) // 2)), "0-d")
    # Autograd leaves are communicated through a detached view, in place.
    leaf = torch.ones(3, requires_grad=True)
    comm.allreduce(leaf)
    expect(leaf.detach(), torch.full((3,), float(n)), "requires_grad leaf")
    expect(comm.allreduce_scalars([r, 1.0, 0.5]), [float(n * (n - 1) // 2), float(n), n / 2],
           "scalars sum")
    expect(comm.allreduce_scalars([r], op="max"), [float(n - 1)], "scalars max")
    expect(comm.allreduce_scalars([], op="avg"), [], "scalars empty")


def check_gather_scatter(comm):
    r, n = comm.rank, comm.size
    for dt in DTYPES + (torch.bool,):
        t = torch.full((2, 3), r % 2 if dt == torch.bool else r, dtype=dt)
        want = torch.arange(n).repeat_interleave(2)[:, None].expand(2 * n, 3)
        want = (want % 2 if dt == torch.bool else want).to(dt).contiguous()
        expect(comm.allgather(t), want, f"allgather {dt}")
        out = torch.empty(2 * n, 3, dtype=dt)
        got = comm.allgather(t, out=out)
        expect(got, want, f"allgather out= {dt}")
        if got.data_ptr() != out.data_ptr():
            raise AssertionError("allgather did not return out")
    for dt in DTYPES:
        # Rank r contributes row i = r + i; the sum over ranks is sum(r) + n * i.
        rows = torch.arange(3 * n)[:, None].expand(3 * n, 2)
        t = (rows + r).to(dt).contiguous()
        want_full = rows * n + n * (n - 1) // 2
        want = want_full[3 * r:3 * r + 3].to(dt)
        expect(comm.reduce_scatter(t), want, f"reduce_scatter {dt}")
        expect(comm.reduce_scatter(t, op="max"), (rows + n - 1)[3 * r:3 * r + 3].to(dt),
               f"reduce_scatter max {dt}")
        if dt.is_floating_point:
            out = torch.empty(3, 2, dtype=dt)
            got = comm.reduce_scatter(t, out=out, op="avg")
            expect(got, (want_full.double() / n)[3 * r:3 * r + 3].to(dt),
                   f"reduce_scatter avg {dt}")
    # Large float tensors take the ring path (>= 256 KiB): every op, exact small integers.
    big = torch.arange(n * 40_000, dtype=torch.float64).remainder(16)[:, None].expand(-1, 2)
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        t = (big + r).to(dt).contiguous()
        mine = slice(40_000 * r, 40_000 * (r + 1))
        cases = {"sum": big * n + n * (n - 1) // 2, "max": big + n - 1, "min": big,
                 "avg": big + (n - 1) / 2}
        for op, full in cases.items():
            expect(comm.reduce_scatter(t, op=op), full[mine].to(dt), f"ring reduce_scatter {op} {dt}")
    for dt in DTYPES + (torch.bool,):
        # Chunk j of rank r is 10 * r + j and goes to rank j.
        t = (10 * r + torch.arange(n)).repeat_interleave(2)
        want = (10 * torch.arange(n) + r).repeat_interleave(2)
        if dt == torch.bool:
            t, want = t % 3 == 0, want % 3 == 0
        expect(comm.alltoall(t.to(dt)), want.to(dt), f"alltoall {dt}")


def check_broadcast(comm):
    r, n = comm.rank, comm.size
    root = 1 if n > 1 else 0
    for dt in DTYPES + (torch.bool,):
        t = torch.full((3, 2), r + 7, dtype=dt) if dt != torch.bool else torch.tensor([r == root])
        want = torch.full((3, 2), root + 7, dtype=dt) if dt != torch.bool else torch.tensor([True])
        got = comm.broadcast(t, root=root)
        expect(got, want, f"broadcast {dt}")
        if got is not t:
            raise AssertionError("broadcast is not in place")


def check_p2p(comm, backend):
    r, n = comm.rank, comm.size
    right, left = (r + 1) % n, (r - 1) % n
    if n > 1:
        for dt in (torch.float32, torch.bfloat16, torch.int64):
            msg, buf = torch.full((4,), r + 1, dtype=dt), torch.zeros(4, dtype=dt)
            if r % 2 == 0:  # even ranks send first so the blocking ring cannot deadlock
                comm.send(msg, right, tag=3)
                comm.recv(buf, left, tag=3)
            else:
                got = comm.recv(buf, left, tag=3)
                if got is not buf:
                    raise AssertionError("recv did not return its buffer")
                comm.send(msg, right, tag=3)
            expect(buf, torch.full((4,), left + 1, dtype=dt), f"ring send/recv {dt}")
    if n > 1 or backend.startswith("mpi"):  # torch.distributed cannot send to itself
        for dt in (torch.float32, torch.float16):
            msg, buf = torch.full((2, 2), r + 1, dtype=dt), torch.zeros(2, 2, dtype=dt)
            recv_req = comm.irecv(buf, left, tag=5)
            send_req = comm.isend(msg, right, tag=5)
            send_req.wait()
            recv_req.wait()
            if not (recv_req.test() and send_req.test()):
                raise AssertionError("test() is False after wait()")
            expect(buf, torch.full((2, 2), left + 1, dtype=dt), f"isend/irecv {dt}")
        check_boxes(comm, left, right)
        check_exchange(comm, left, right)
        check_p2p_group(comm, left, right, backend)
    comm.barrier()


def check_p2p_group(comm, left, right, backend):
    """p2p_group: every rank sends to both neighbours and receives from both in ONE group,
    sends listed first, with synchronous sends (each completes only once its receive has
    started): posted one by one and waited in order, this would hang; as a group it cannot.
    Two messages on one tag and direction arrive in the order they were posted."""
    r = comm.rank
    for synchronous in (True, False):
        out_r = [torch.full((3,), 10 * r + k, dtype=torch.float64) for k in range(2)]
        out_l = torch.full((5,), -r, dtype=torch.float32)
        in_l = [torch.zeros(3, dtype=torch.float64) for _ in range(2)]
        in_r = torch.zeros(5, dtype=torch.float32)
        req = comm.p2p_group(sends=[(out_r[0], right, 0), (out_r[1], right, 0), (out_l, left, 1)],
                             recvs=[(in_l[0], left, 0), (in_l[1], left, 0), (in_r, right, 1)],
                             synchronous=synchronous)
        if synchronous:
            while not req.test():
                pass
        else:
            req.wait()
        for k in range(2):
            expect(in_l[k], torch.full((3,), 10 * left + k, dtype=torch.float64),
                   f"p2p_group message {k} from the left, synchronous={synchronous}")
        expect(in_r, torch.full((5,), -right, dtype=torch.float32),
               f"p2p_group from the right, synchronous={synchronous}")
    if backend.startswith("mpi"):  # a synchronous send: not complete before its receive is posted
        x, y = torch.ones(4), torch.zeros(4)
        send = comm.p2p_group(sends=[(x, right, 9)], synchronous=True)
        early = send.test()
        comm.barrier()  # no rank posts its receive before every rank has tested
        comm.p2p_group(recvs=[(y, left, 9)]).wait()
        send.wait()
        if early:
            raise AssertionError("a synchronous p2p_group send completed before its receive")
    expect_raises(ValueError, "not a rank", lambda: comm.p2p_group(
        sends=[(out_l, comm.size, 0)]), "p2p_group to a rank outside the communicator")


def check_boxes(comm, left, right):
    """isend_boxes/irecv_boxes: strided boxes in, strided boxes out, one message, in order."""
    def field(rank, dt):
        g = torch.Generator().manual_seed(rank)
        return (torch.randn(2, 3, 7, 9, generator=g) * 5).to(dt)
    send_boxes = (((0, 1), (0, 9)), ((6, 7), (2, 5)), ((3, 5), (0, 9)), ((2, 2), (0, 9)))
    recv_boxes = (((0, 1), (1, 10)), ((8, 9), (0, 3)), ((4, 6), (1, 10)), ((0, 0), (2, 11)))
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool):
        for strided in (False, True):
            x = field(comm.rank, dt)
            if strided:  # a non-contiguous source: every other column of a wider tensor
                x = torch.zeros(2, 3, 7, 18, dtype=dt)[..., ::2].copy_(x)
            win = torch.zeros(2, 3, 9, 11, dtype=dt)
            req = comm.irecv_boxes(win, recv_boxes, left, tag=7)
            comm.isend_boxes(x, send_boxes, right, tag=7).wait()
            req.wait()
            src, want = field(left, dt), torch.zeros(2, 3, 9, 11, dtype=dt)
            for (a, b), (c, d) in zip(send_boxes, recv_boxes):
                want[..., c[0]:c[1], d[0]:d[1]] = src[..., a[0]:a[1], b[0]:b[1]]
            expect(win, want, f"isend_boxes/irecv_boxes {dt} strided={strided}")
    expect_raises(ValueError, "does not fit", lambda: comm.isend_boxes(
        torch.zeros(2, 3), (((0, 4),),), right), "box outside the tensor")


def check_exchange(comm, left, right):
    """boxes_exchange: two messages each way, started many times over new addresses, layouts
    and dtypes (the prepared messages must follow the tensors), never stale data."""
    send_a, recv_a = (((0, 1), (0, 9)), ((6, 7), (2, 5))), (((0, 1), (1, 10)), ((8, 9), (0, 3)))
    send_b, recv_b = (((3, 5), (0, 9)),), (((4, 6), (1, 10)),)
    ex = comm.boxes_exchange(recvs=[(left, 3, recv_a), (right, 4, recv_b)],
                             sends=[(right, 3, send_a), (left, 4, send_b)])

    def field(rank, step, dt, strided):
        g = torch.Generator().manual_seed(rank * 1000 + step)
        x = (torch.randn(2, 3, 7, 9, generator=g) * 5).to(dt)
        if strided:
            x = torch.zeros(2, 3, 7, 18, dtype=dt)[..., ::2].copy_(x)
        return x

    def want(step, dt, strided, old):
        out = old.clone()
        for src_rank, sends, recvs in ((left, send_a, recv_a), (right, send_b, recv_b)):
            src = field(src_rank, step, dt, strided)
            for (a, b), (c, d) in zip(sends, recvs):
                out[..., c[0]:c[1], d[0]:d[1]] = src[..., a[0]:a[1], b[0]:b[1]]
        return out

    wins, reused = {}, {}
    keep = []  # distinct live sources: more addresses than the exchange keeps prepared
    for step in range(80):
        dt = (torch.float32, torch.float64, torch.int64)[step % 3] if step < 12 else torch.float32
        strided = step % 4 == 1
        x = field(comm.rank, step, dt, strided)
        if step % 2 == 0:  # the same source again (prepared messages reused), new values
            x = reused.setdefault((dt, strided), x).copy_(x)
        else:
            keep.append(x)
        win = wins.setdefault(dt, torch.full((2, 3, 9, 11), -1, dtype=dt))
        old = win.clone()
        req = ex.start(win, x)
        if step % 2:
            while not req.test():
                pass
        req.wait()
        expect(win, want(step, dt, strided, old), f"boxes_exchange step {step} {dt} strided={strided}")
        comm.barrier()  # no rank rewrites a source a slower peer still reads
    expect_raises(ValueError, "does not fit", lambda: ex.start(torch.zeros(2, 3, 9, 4), x),
                  "window too small for the boxes")
    expect_raises(TypeError, "recv_into must be a torch.Tensor", lambda: ex.start(None, x),
                  "missing window")
    expect_raises(ValueError, "not a rank", lambda: comm.boxes_exchange(
        [(comm.size, 0, recv_a)], []), "bad peer")
    expect_raises(ValueError, "start <= stop", lambda: comm.boxes_exchange(
        [], [(right, 0, (((3, 1),),))]), "reversed box")


NB_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool)


def uneven(rank, n, dt, rows=None, cols=3):
    """A rank-dependent tensor of small exact values, different on every row and rank."""
    rows = rows or 2 * n
    x = (torch.arange(rows * cols).reshape(rows, cols) * (rank + 1) + 3 * rank) % 23
    return (x % 3 == 0 if dt == torch.bool else x).to(dt)


def finish(req, how):
    """Complete ``req`` one of three ways and return its out."""
    if how == "wait":
        return req.wait()
    if how == "idle":
        return wait_all([req], idle=True)[0]
    deadline = MPI.Wtime() + 30
    while not req.test():  # test() alone must get there (it drives MPI's progress)
        if MPI.Wtime() > deadline:
            raise AssertionError("test() never became True")
    if not req.test():
        raise AssertionError("test() went back to False")
    return req.out


def check_nonblocking(comm):
    """iallreduce / iallgather / ireduce_scatter equal the blocking calls, for every dtype the
    backends convert (bf16 staged in float32, bool as bytes), out= given or not, completed
    by wait(), test() polling or wait_all, several in flight finished out of order."""
    r, n = comm.rank, comm.size
    hows = ("wait", "test", "idle")
    k = 0
    for dt in NB_DTYPES:
        ops = ("max", "min") if dt == torch.bool else (
            ("sum", "max", "avg") if dt.is_floating_point else ("sum", "min"))
        for op in ops:
            x = uneven(r, n, dt)
            want = comm.allreduce(x.clone(), op=op)
            req = comm.iallreduce(x, op=op)
            got = finish(req, hows[k % 3])
            k += 1
            if got is not x or req.out is not x:
                raise AssertionError("iallreduce is not in place")
            expect(x, want, f"iallreduce {op} {dt}")
            if dt == torch.bool:
                continue  # reduce_scatter takes the same ops; one bool case below
            x = uneven(r, n, dt)
            want = comm.reduce_scatter(x, op=op)
            out = torch.full((2,) + x.shape[1:], 7, dtype=dt) if k % 2 else None
            req = comm.ireduce_scatter(x, out=out, op=op)
            got = finish(req, hows[k % 3])
            if out is not None and got is not out:
                raise AssertionError("ireduce_scatter did not return out")
            expect(got, want, f"ireduce_scatter {op} {dt} out={out is not None}")
        for with_out in (False, True):
            x = uneven(r, n, dt, rows=3)
            out = torch.zeros((3 * n, 3), dtype=dt) if with_out else None
            req = comm.iallgather(x, out=out)
            got = finish(req, hows[k % 3])
            k += 1
            if with_out and (got is not out or req.out is not out):
                raise AssertionError("iallgather did not return out")
            expect(got, comm.allgather(x), f"iallgather {dt} out={with_out}")
    flags = uneven(r, n, torch.bool)
    expect(comm.ireduce_scatter(flags, op="max").wait(), comm.reduce_scatter(flags, op="max"),
           "ireduce_scatter bool or")

    # Several in flight, interleaved with a blocking collective and with compute, completed
    # in another order than started (every rank starts them in the same order).
    a = uneven(r, n, torch.float32)
    b = uneven(r, n, torch.bfloat16, rows=5)
    c = uneven(r, n, torch.float64, rows=4 * n)
    d = uneven(r, n, torch.int64)
    want_a = comm.allreduce(a.clone(), op="avg")
    want_b, want_c = comm.allgather(b), comm.reduce_scatter(c, op="sum")
    want_d = comm.allreduce(d.clone(), op="max")
    big = torch.arange(n * 70_000, dtype=torch.float32).remainder(9) + r  # 280 KiB per rank
    want_big = comm.reduce_scatter(big)
    reqs = [comm.iallreduce(a, op="avg"), comm.iallgather(b), comm.ireduce_scatter(c)]
    blocking = comm.allreduce(torch.full((2,), r + 1.0))
    reqs += [comm.iallreduce(d, op="max"), comm.ireduce_scatter(big)]
    m = torch.ones(64, 64)
    for _ in range(5):  # compute between start and wait
        m = (m @ m) / 64
    expect(blocking, torch.full((2,), n * (n + 1) / 2), "blocking allreduce among requests")
    expect(m, torch.ones(64, 64), "compute during requests")
    expect(reqs[2].wait(), want_c, "in flight: ireduce_scatter fp64 (waited first)")
    expect(finish(reqs[4], "test"), want_big, "in flight: large ireduce_scatter")
    # Large floating ones (the MPI backend's pairwise exchange), every op, several in flight.
    bigs = {op: (torch.arange(n * 70_000, dtype=torch.float64).remainder(7) + 1 + r) / 4
            for op in ("sum", "avg", "max", "min", "prod")}
    wants = {op: comm.reduce_scatter(t, op=op) for op, t in bigs.items()}
    started = {op: comm.ireduce_scatter(t, op=op) for op, t in bigs.items()}
    for op in reversed(list(started)):
        expect(finish(started[op], hows[len(op) % 3]), wants[op], f"large ireduce_scatter {op}")
    outs = wait_all([reqs[3], reqs[0], reqs[1]])
    expect(outs[0], want_d, "in flight: iallreduce int64 max")
    expect(outs[1], want_a, "in flight: iallreduce fp32 avg")
    expect(outs[2], want_b, "in flight: iallgather bf16")
    for q in reqs:  # complete: test() stays True, wait() returns the same out again
        if not q.test() or q.wait() is not q.out:
            raise AssertionError("a completed request changed its mind")

    # Bad input: the blocking calls' checks, raised before anything is started.
    expect_raises(ValueError, "bool tensors", lambda: comm.iallreduce(flags, op="sum"),
                  "iallreduce bool sum")
    expect_raises(ValueError, "op='avg' needs a floating-point tensor",
                  lambda: comm.iallreduce(d, op="avg"), "iallreduce int avg")
    expect_raises(ValueError, "unknown reduction op",
                  lambda: comm.ireduce_scatter(c, op="mean"), "ireduce_scatter bad op")
    expect_raises(ValueError, "0-d tensor", lambda: comm.iallgather(torch.tensor(1.0)),
                  "iallgather 0-d")
    expect_raises(ValueError, "iallgather: out has shape",
                  lambda: comm.iallgather(a, out=torch.empty(1, 3)), "iallgather bad out")
    expect_raises(TypeError, "out has dtype torch.float64",
                  lambda: comm.ireduce_scatter(a, out=torch.empty(2, 3, dtype=torch.float64)),
                  "ireduce_scatter out dtype")
    expect_raises(ValueError, "not contiguous", lambda: comm.iallreduce(torch.ones(3, 4).t()),
                  "iallreduce non-contiguous")
    if n > 1:
        expect_raises(ValueError, f"ireduce_scatter needs tensor.shape[0] divisible by the "
                      f"communicator size {n}", lambda: comm.ireduce_scatter(
                          torch.ones(n + 1, 2)), "ireduce_scatter indivisible")
    else:
        expect_raises(ValueError, "overlaps", lambda: comm.ireduce_scatter(a, out=a),
                      "ireduce_scatter out overlaps")


def check_all(comm, backend):
    """Run every data check on ``comm``."""
    check_reductions(comm)
    check_gather_scatter(comm)
    check_broadcast(comm)
    check_p2p(comm, backend)


def check_splits(comm, backend):
    r, n = comm.rank, comm.size
    parity = comm.split(r % 2, key=r)
    expect((parity.rank, parity.size), (r // 2, (n - r % 2 + 1) // 2), "even/odd split")
    check_all(parity, backend)
    nested = parity.split(0, key=-parity.rank)  # a split of a subgroup
    expect(nested.rank, parity.size - 1 - parity.rank, "nested split rank")
    check_all(nested, backend)
    nested.free()
    parity.free()

    reverse = comm.split(0, key=-r)  # a key that reverses the rank order
    expect(reverse.rank, n - 1 - r, "reversed split rank")
    got = reverse.allgather(torch.tensor([r]))
    expect(got, torch.arange(n - 1, -1, -1), "reversed split allgather order")
    check_all(reverse, backend)
    check_nonblocking(reverse)  # a subgroup (not the default group) whose ranks are reordered
    reverse.free()

    again = comm.split(r % 2, key=r)  # the same groups again must work (they are reused)
    expect(again.allreduce(torch.ones(1)), torch.full((1,), float(again.size)), "re-split")
    again.free()

    partial = comm.split(None if r % 2 else 0)
    if r % 2:
        check_null(partial, backend)
    else:
        expect(partial.size, (n + 1) // 2, "partial split size")
        expect(partial.allreduce(torch.ones(1)), torch.full((1,), float(partial.size)), "partial")
    partial.free()
    check_null(comm.split(None), backend)


def check_null(null, backend):
    if not isinstance(null, NullCommunicator):
        raise AssertionError(f"expected a NullCommunicator, got {null!r}")
    expect((null.is_active, null.rank, null.size, null.backend), (False, -1, 0, backend),
           "NullCommunicator attributes")
    expect_raises(RuntimeError, "not a member", lambda: null.allreduce(torch.ones(1)), "null")
    expect_raises(RuntimeError, "not a member", lambda: null.send(torch.ones(1), 0), "null send")
    expect_raises(RuntimeError, "not a member", null.barrier, "null barrier")
    for name in ("iallreduce", "iallgather", "ireduce_scatter"):
        expect_raises(RuntimeError, f"{name}() on a NullCommunicator",
                      lambda: getattr(null, name)(torch.ones(2)), f"null {name}")
    null.free()
    null.free()


def check_zero_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view, datatype = _as_buffer(t)
    if not np.shares_memory(view, t.numpy()) or datatype != MPI.FLOAT:
        raise AssertionError("the MPI buffer of a float32 tensor is a copy")
    h = torch.ones(5, dtype=torch.bfloat16)
    view, datatype = _as_buffer(h)
    if view.ctypes.data != h.data_ptr() or view.nbytes != 10 or datatype != MPI.BYTE:
        raise AssertionError("the MPI buffer of a bfloat16 tensor is not its raw bytes")


def check_op_timeout(comm):
    """extend_op_timeout gives torch's groups, made before and after, the longer timeout (so
    the stall watchdog reports before torch's own watchdog ends the process)."""
    import datetime

    from torch.distributed import distributed_c10d as c10d

    from hpctrain.runtime.comm import torchdist

    def timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    comm.extend_op_timeout(30)  # shorter than the 60 s it was made with: nothing changes
    expect(timeout(c10d._get_default_group()), datetime.timedelta(seconds=60), "kept timeout")
    comm.extend_op_timeout(700)
    groups = [c10d._get_default_group(), *torchdist._GROUPS.values()]
    expect([timeout(g) for g in groups], [datetime.timedelta(seconds=700)] * len(groups),
           "extended timeouts")
    fresh = comm.split(0, key=(comm.rank + 1) % comm.size)  # a rank order not made before
    if comm.size > 1:  # at one rank it is the default group
        expect(timeout(fresh.group), datetime.timedelta(seconds=700), "a later group's timeout")
    expect(fresh.allreduce(torch.ones(1)), torch.full((1,), float(comm.size)), "allreduce")
    fresh.free()


def main(backend):
    if backend == "mpi":
        comm = world()
        check_zero_copy()
    else:
        comm = TorchDistCommunicator.create(MPI.COMM_WORLD, backend=backend, timeout_s=60)
        expect(str(comm.device), "cpu", "gloo device")
        again = TorchDistCommunicator.create(MPI.COMM_WORLD, backend=backend)  # reuses
        again.free()  # must not tear down the default group it did not create
    expect((comm.backend, comm.rank, comm.size),
           (backend, MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size), "attributes")
    check_all(comm, backend)
    check_nonblocking(comm)
    check_splits(comm, backend)
    if backend != "mpi":
        check_op_timeout(comm)  # the list-based fallbacks for backends without tensor collectives
        comm._native_collectives = False
        check_gather_scatter(comm)
        check_nonblocking(comm)
    comm.barrier()
    comm.free()
    if comm.rank == 0:
        print(f"comm_worker OK backend={backend} size={comm.size}", flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:]:  # several backends: one after another, one process start
        main(name)
