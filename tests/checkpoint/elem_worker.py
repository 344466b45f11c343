"""mpirun worker for test_elem_shards: write or read synthetic flat-sharded entries.

    python -m tests.checkpoint.elem_worker write PATH [--block-bytes B] [--gap]
    python -m tests.checkpoint.elem_worker read PATH
    python -m tests.checkpoint.elem_worker batch OPS.json
Prints "rank R: OK" per rank, or "rank R: <error>" and exits 3. ``batch`` runs many
operations in this one process, each [mode, path, block_bytes, env, gap?] (env set for it
only; gap as --gap), and prints "rank R: OK N" after the N-th; it stops at the first error,
as one op would.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.checkpoint import layout
from hpctrain.checkpoint.layout import Entry
from hpctrain.checkpoint.reader import CheckpointError, Reader
from hpctrain.checkpoint.state import write_entries
from tests.mpirun import patched_env

# (name, shape, dtype): flat-sharded over one padded buffer, in this order.
FLAT = [("flat/m13x7", (13, 7), torch.float32), ("flat/v29", (29,), torch.float64),
        ("flat/t3x5x11", (3, 5, 11), torch.float32), ("flat/scalar", (), torch.float32),
        ("flat/bf16", (6, 9), torch.bfloat16), ("flat/i64", (17,), torch.int64),
        ("flat/empty", (0, 4), torch.float32), ("flat/tail", (5, 3), torch.float32)]
ROWS = ("rows/w", (10, 3), torch.float32)   # sharded by rows
REP = ("rep/b", (5, 4), torch.float64)      # replicated
PAD = 3  # padding elements at the end of the flat buffer (not written)
# N-D hyperslabs, as tensor parallel writes them: a column slice per rank (uneven), and a
# slice along dim 2 over tp=2 (tp=1 at an odd world) flat-sharded over the rest (tp x zero).
COLS = ("box/cols", (12, 10), torch.float32)
TPDP = ("box/tpdp", (4, 6, 5), torch.float64)


def _cuts(n: int, parts: int) -> list[int]:
    return [n * i // parts for i in range(parts + 1)]


def box_parts(rank: int, world: int) -> list[tuple]:
    """This rank's (box, elems or None) of COLS and TPDP."""
    c = _cuts(COLS[1][1], world)
    cols = (((0, c[rank]), (COLS[1][0], c[rank + 1] - c[rank])), None)
    tp = 2 if world % 2 == 0 else 1
    dp, t, d = world // tp, rank % tp, rank // tp
    k = _cuts(TPDP[1][2], tp)
    count = (TPDP[1][0], TPDP[1][1], k[t + 1] - k[t])
    e = _cuts(int(np.prod(count)), dp)
    return [cols, (((0, 0, k[t]), count), (e[d], e[d + 1]))]


def box_local(spec: tuple, part: tuple) -> torch.Tensor:
    (off, cnt), elems = part
    t = tensor(*spec)[tuple(slice(o, o + n) for o, n in zip(off, cnt))]
    return t if elems is None else t.reshape(-1)[elems[0]:elems[1]].clone()


def tensor(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Deterministic content per name."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def flat_ranges(world: int) -> list[list[tuple]]:
    """Per rank, per FLAT tensor: its (start, stop) elements of a padded buffer split evenly."""
    sizes = [int(np.prod(s, dtype=np.int64)) for _, s, _ in FLAT]
    total = sum(sizes) + PAD
    per = -(-total // world)
    out = []
    for r in range(world):
        lo, hi, at, mine = r * per, min((r + 1) * per, total), 0, []
        for n in sizes:
            s, e = min(max(lo - at, 0), n), min(max(hi - at, 0), n)
            mine.append((s, max(s, e)))
            at += n
        out.append(mine)
    return out


def entries(rank: int, world: int, gap: bool) -> list[Entry]:
    out = []
    for (name, shape, dtype), (s, e) in zip(FLAT, flat_ranges(world)[rank]):
        if gap and rank == 0 and name == "flat/m13x7" and e > s:
            e -= 1  # leaves one element unwritten
        out.append(Entry(name, shape, dtype, tensor(name, shape, dtype).reshape(-1)[s:e].clone(),
                         elems=(s, e)))
    name, shape, dtype = ROWS
    lo, hi = rank * shape[0] // world, (rank + 1) * shape[0] // world
    out.append(Entry(name, shape, dtype, tensor(name, shape, dtype)[lo:hi].clone(), rows=(lo, hi)))
    out.append(Entry(REP[0], REP[1], REP[2], tensor(*REP)))
    for spec, part in zip((COLS, TPDP), box_parts(rank, world)):
        out.append(Entry(spec[0], spec[1], spec[2], box_local(spec, part).clone(), box=part[0],
                         elems=part[1]))
    return out


def check_read(path: str, rank: int, world: int, comm) -> None:
    with Reader(path) as r:
        for (name, shape, dtype), (s, e) in zip(FLAT, flat_ranges(world)[rank]):
            want = tensor(name, shape, dtype)
            got = r.read(name, shape, elems=(s, e))
            if got is not None:
                got = layout.from_numpy(got, dtype)
                assert got.shape == (e - s,), (name, got.shape, (s, e))
                assert torch.equal(got, want.reshape(-1)[s:e]), (name, s, e)
            whole = r.read(name, shape)
            if whole is not None:
                assert torch.equal(layout.from_numpy(whole, dtype), want), name
        name, shape, dtype = ROWS
        lo, hi = rank * shape[0] // world, (rank + 1) * shape[0] // world
        got = r.read(name, shape, rows=(lo, hi))
        if got is not None:
            assert torch.equal(torch.from_numpy(got), tensor(*ROWS)[lo:hi]), name
        got = r.read(REP[0], REP[1])
        if got is not None:
            assert torch.equal(torch.from_numpy(got), tensor(*REP)), REP[0]
        for spec, part in zip((COLS, TPDP), box_parts(rank, world)):
            got = r.read(spec[0], spec[1], box=part[0], elems=part[1])
            if got is not None:
                assert torch.equal(torch.from_numpy(got), box_local(spec, part)), (spec[0], part)
            whole = r.read(spec[0], spec[1])
            if whole is not None:
                assert torch.equal(torch.from_numpy(whole), tensor(*spec)), spec[0]
        r.check(comm)


DEFAULT_BLOCK_BYTES = layout.BLOCK_BYTES


def run(mode: str, path: str, block_bytes: int, gap: bool, comm) -> None:
    rank, world = comm.Get_rank(), comm.Get_size()
    # many blocks, cut by the ranges (0: the default)
    layout.BLOCK_BYTES = block_bytes or DEFAULT_BLOCK_BYTES
    if mode == "write":
        write_entries(path, entries(rank, world, gap), {"world_size": np.int64(world)}, comm)
    else:
        check_read(path, rank, world, comm)


def batch(ops_path: str, comm) -> None:
    with open(ops_path) as f:
        ops = json.load(f)
    for i, (mode, path, block_bytes, env, *gap) in enumerate(ops):
        with patched_env(env):
            run(mode, path, block_bytes, bool(gap and gap[0]), comm)
        comm.Barrier()
        # One write per line: print() writes the text and the newline apart, and mpirun
        # may interleave another rank's line between them.
        sys.stdout.write(f"rank {comm.Get_rank()}: OK {i}\n")
        sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["write", "read", "batch"])
    p.add_argument("path")
    p.add_argument("--block-bytes", type=int, default=0)
    p.add_argument("--gap", action="store_true")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        if a.mode == "batch":
            batch(a.path, comm)
        else:
            run(a.mode, a.path, a.block_bytes, a.gap, comm)
    except (CheckpointError, ValueError) as exc:
        print(f"rank {rank}: {exc}", flush=True)
        return 3
    print(f"rank {rank}: OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
