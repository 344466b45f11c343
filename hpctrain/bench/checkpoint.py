"""Checkpoint bandwidth: hpctrain vs torch.distributed.checkpoint (gloo) vs dd, same bytes/disk.

Run under mpirun (e.g. ``mpirun -n 2 python -m hpctrain bench checkpoint``); rank 0 prints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import torch
from torch import nn

__all__ = ["run"]


def _model(mb: int) -> nn.Module:
    # Square fp32 layers of ~64 MB each (the last one smaller): many large tensors.
    side = 4096
    per = side * side * 4
    layers = [nn.Linear(side, side, bias=True) for _ in range(max(1, mb * 2**20 // per))]
    return nn.Sequential(*layers)


def _timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def run(mb: int = 400, directory: str = "") -> int:
    """Write and read the same state three ways; print seconds, GB/s and the ratios."""
    from hpctrain.checkpoint.layout import Entry
    from hpctrain.checkpoint.reader import Reader
    from hpctrain.checkpoint.state import write_entries
    from hpctrain.runtime.world import init_world

    world = init_world()
    comm = world.mpi_comm
    torch.manual_seed(0)
    model = _model(mb)
    sd = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    root = directory or (tempfile.mkdtemp(prefix="hpctrain-bench-") if world.rank == 0 else "")
    root = comm.bcast(root)
    res = {}

    # hpctrain: parallel HDF5, every rank writes its rows of each tensor.
    h5 = os.path.join(root, "bench.h5")
    entries = [Entry(f"model/{k}", tuple(t.shape), t.dtype, t) for k, t in sd.items()]
    res["hpctrain write"] = _timed(comm, lambda: write_entries(h5, entries, {}, comm))

    def read_h5():
        with Reader(h5) as r:
            for e in entries:  # every rank needs the whole replicated state
                r.read(e.name, e.shape)
            r.check()
    res["hpctrain read"] = _timed(comm, read_h5)

    # torch.distributed.checkpoint over a gloo group on the same ranks.
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000 if world.rank == 0 else 0))
    os.environ["MASTER_PORT"] = comm.bcast(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", rank=world.rank, world_size=world.size)
    dcp_dir = os.path.join(root, "dcp")
    res["dcp write"] = _timed(comm, lambda: dcp.save(sd, checkpoint_id=dcp_dir))
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    res["dcp read"] = _timed(comm, lambda: dcp.load(target, checkpoint_id=dcp_dir))
    dist.destroy_process_group()

    # dd: the same byte count, written (and synced) and read by rank 0 alone.
    raw = os.path.join(root, "dd.bin")
    count = -(-nbytes // 2**20)
    if world.rank == 0:
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={raw}", "bs=1M", f"count={count}",
                        "conv=fdatasync"], check=True, capture_output=True)
        res["dd write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={raw}", "of=/dev/null", "bs=1M"], check=True, capture_output=True)
        res["dd read"] = time.perf_counter() - t0
        gb = nbytes / 1e9
        print(f"checkpoint bench: {gb:.2f} GB state, {world.size} ranks, dir {root}")
        for k, v in res.items():
            print(f"  {k:<16} {v:7.3f} s  {gb / v:6.2f} GB/s")
        print(f"  write bandwidth hpctrain/dd = {res['dd write'] / res['hpctrain write']:.2f}x  "
              f"(target >= 0.5)")
        print(f"  save time hpctrain/dcp      = {res['hpctrain write'] / res['dcp write']:.2f}x  "
              f"(target <= 1)")
        print(f"  read time hpctrain/dcp      = {res['hpctrain read'] / res['dcp read']:.2f}x")
        if not directory:
            shutil.rmtree(root, ignore_errors=True)
    comm.Barrier()
    return 0
