"""Run under mpirun (2 ranks): the staged communicator, forced to copy through host buffers on
the CPU, against exact values (comm_worker's checks) and against the plain MPICommunicator.

Usage: ``python tests/runtime/staged_worker.py OUT [cuda]``; rank 0 writes a JSON report to
OUT: ``{"checked": [names...], "flight": {...}}``. Any mismatch raises (exit code != 0). With
``cuda`` (a GPU machine: every rank on the current GPU, no forced staging) the staged ops run
on CUDA tensors and comm_worker's CPU-only checks are left out.
"""

import json
import os
import sys

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comm_worker  # noqa: E402  (the many-checks worker of every backend)

from hpctrain.runtime.comm import NullCommunicator, wait_all  # noqa: E402
from hpctrain.runtime.comm.mpi import MPICommunicator  # noqa: E402
from hpctrain.runtime.comm.staged import StagedCommunicator  # noqa: E402
from hpctrain.runtime.flight import RECORDER  # noqa: E402

BACKEND = "mpi-staged"


def rand(comm, seed, shape, dt):
    """Rank- and seed-dependent values, the same on both communicators, on comm's device."""
    g = torch.Generator().manual_seed(1000 * comm.rank + seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 4
    return (x.to(dt) if dt.is_floating_point else x.round().to(dt)).to(comm.device)


def run_ops(comm):
    """Every op on ``comm``; return {name: result tensor} (same inputs whatever the comm)."""
    r, n = comm.rank, comm.size
    right, left = (r + 1) % n, (r - 1) % n
    dev = comm.device
    res = {}
    # A value the device computes just before the op: the staging must wait for it.
    m = 2048 if dev.type == "cuda" else 64
    ones = torch.ones(m, m, device=dev)
    res["allreduce of a fresh matmul"] = comm.allreduce((ones @ ones)[:4, :4] / m * (r + 1))
    res["isend of a fresh matmul"] = torch.zeros(4, device=dev)
    reqs = [comm.irecv(res["isend of a fresh matmul"], left, tag=1),
            comm.isend((ones @ ones)[0, :4] / m + r, right, tag=1)]
    wait_all(reqs)
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        for op in ("sum", "avg", "max") if dt.is_floating_point else ("sum", "min"):
            res[f"allreduce {op} {dt}"] = comm.allreduce(rand(comm, 1, (5, 3), dt), op=op)
        res[f"allgather {dt}"] = comm.allgather(rand(comm, 2, (3, 2), dt))
        res[f"reduce_scatter {dt}"] = comm.reduce_scatter(rand(comm, 3, (2 * n, 3), dt))
        res[f"broadcast {dt}"] = comm.broadcast(rand(comm, 4, (4,), dt), root=n - 1)
        res[f"alltoall {dt}"] = comm.alltoall(rand(comm, 5, (2 * n, 2), dt))
        res[f"iallreduce {dt}"] = comm.iallreduce(rand(comm, 6, (7,), dt)).wait()
        res[f"iallgather {dt}"] = comm.iallgather(rand(comm, 7, (2, 2), dt)).wait()
        res[f"ireduce_scatter {dt}"] = comm.ireduce_scatter(rand(comm, 8, (n, 5), dt)).wait()
    # Large floating reductions: MPI's ring and pairwise paths (>= 256 KiB).
    big = rand(comm, 9, (n * 40_000, 2), torch.float32)
    res["reduce_scatter ring avg"] = comm.reduce_scatter(big, op="avg")
    res["ireduce_scatter pairwise"] = comm.ireduce_scatter(big).wait()
    flags = rand(comm, 10, (6,), torch.int64) > 0
    res["allreduce bool or"] = comm.allreduce(flags.clone(), op="max")
    res["allgather bool"] = comm.allgather(flags)
    res["scalars"] = torch.tensor(comm.allreduce_scalars([r + 0.5, 2.0 ** r], op="sum"))
    comm.barrier()

    # Point to point: blocking ring (even ranks send first), non-blocking, one group.
    buf = torch.zeros(4, 3, device=dev)
    if r % 2 == 0:
        comm.send(rand(comm, 11, (4, 3), torch.float32), right, tag=2)
        comm.recv(buf, left, tag=2)
    else:
        comm.recv(buf, left, tag=2)
        comm.send(rand(comm, 11, (4, 3), torch.float32), right, tag=2)
    res["send/recv"] = buf
    buf = torch.zeros(5, dtype=torch.bfloat16, device=dev)
    reqs = [comm.irecv(buf, left, tag=3), comm.isend(rand(comm, 12, (5,), torch.bfloat16),
                                                     right, tag=3)]
    wait_all(reqs)
    res["isend/irecv"] = buf
    a = torch.zeros(3, dtype=torch.float64, device=dev)
    b = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    comm.p2p_group(sends=[(rand(comm, 13, (3,), torch.float64), right, 4),
                          (rand(comm, 14, (2, 2), torch.int32), left, 5)],
                   recvs=[(a, left, 4), (b, right, 5)], synchronous=True).wait()
    res["p2p_group"] = torch.cat([a, b.double().reshape(-1)])

    # Halo exchange: two messages (from the left and from the right) land in two boxes of ONE
    # tensor at the same time; everything outside the boxes must keep its values.
    src = rand(comm, 15, (2, 6, 8), torch.float32)
    win = torch.full((2, 6, 8), -7.0, device=dev)
    to_right, to_left = (((0, 2), (0, 8)),), (((4, 6), (1, 3)), ((5, 6), (6, 8)))
    from_left, from_right = (((0, 2), (0, 8)),), (((3, 5), (0, 2)), ((5, 6), (2, 4)))
    reqs = [comm.irecv_boxes(win, from_left, left, tag=6),
            comm.irecv_boxes(win, from_right, right, tag=7),
            comm.isend_boxes(src[:, :, :], to_right, right, tag=6),
            comm.isend_boxes(src.transpose(1, 2).contiguous().transpose(1, 2), to_left, left,
                             tag=7)]  # a strided source
    wait_all(reqs[::-1])
    res["boxes two sides"] = win
    ex = comm.boxes_exchange(recvs=[(left, 8, from_left), (right, 9, from_right)],
                             sends=[(right, 8, to_right), (left, 9, to_left)])
    win2 = torch.full((2, 6, 8), 3.0, device=dev)
    ex.start(win2, src).wait()
    res["boxes_exchange"] = win2

    sub = comm.split(0, key=-r)  # reversed order
    res["split allgather"] = sub.allgather(rand(comm, 16, (2,), torch.float32))
    res["split iallreduce"] = sub.iallreduce(rand(comm, 17, (3,), torch.bfloat16), "avg").wait()
    sub.free()
    return res


def check_staging_is_real(staged):
    """The inner MPI hooks see other buffers than the caller's tensors (copies, not views)."""
    seen = []
    inner = staged._inner
    orig = inner._allreduce

    def spy(t, op):
        seen.append(t.data_ptr())
        orig(t, op)
    inner._allreduce = spy
    x = torch.ones(4, device=staged.device)
    staged.allreduce(x)
    del inner._allreduce
    if not seen or seen[0] == x.data_ptr():
        raise AssertionError("the staged allreduce handed the caller's tensor to MPI")
    comm_worker.expect(x.cpu(), torch.full((4,), float(staged.size)), "spied allreduce")


def main(out, device="cpu"):
    plain = MPICommunicator(MPI.COMM_WORLD)
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU: what NCCL refuses
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    staged = StagedCommunicator(MPICommunicator(MPI.COMM_WORLD), dev,
                                force_staging=device == "cpu")
    staged.name = "staged"
    comm_worker.expect((staged.backend, staged.rank, staged.size, staged.device),
                       (BACKEND, plain.rank, plain.size, dev), "attributes")
    check_staging_is_real(staged)
    checked = []

    if device == "cpu":  # exact values: every op, dtype and completion path of comm_worker
        comm_worker.check_all(staged, BACKEND)
        comm_worker.check_nonblocking(staged)
        comm_worker.check_splits(staged, BACKEND)
        checked.append("comm_worker")

    # Against plain MPI: bit for bit.
    want, got = run_ops(plain), run_ops(staged)
    if list(want) != list(got):
        raise AssertionError(f"different ops: {list(want)} vs {list(got)}")
    for name in want:
        if got[name].device != dev:
            raise AssertionError(f"{name}: the result is on {got[name].device}, not {dev}")
        comm_worker.expect(got[name].cpu(), want[name], f"staged vs plain: {name}")
        checked.append(name)

    null = staged.split(None)
    if not isinstance(null, NullCommunicator) or null.backend != BACKEND:
        raise AssertionError(f"split(None) gave {null!r}")

    snap = RECORDER.snapshot()
    mine = [e for e in snap["entries"] if e["group"].startswith("staged[")]
    flight = {"ops": sorted({e["op"] for e in mine}), "pending": len(snap["pending"]),
              "unended": sum(e["end"] is None for e in mine)}
    staged.barrier()
    if staged.rank == 0:
        with open(out, "w") as f:
            json.dump({"checked": checked, "flight": flight, "size": staged.size}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
