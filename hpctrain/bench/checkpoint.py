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
    """Square fp32 layers of up to 64 MB each, ``mb`` MB in all: many large tensors.

    The last layer takes whatever is left, so the state is the size asked for, small too.
    """
    side, left, layers = 4096, mb * 2**20, []
    while left >= 4 * 2 * 2:  # the smallest layer: 1x1 weight + bias
        s = min(side, int(((left // 4) ** 0.5)))
        while s * s + s > left // 4:  # weight and bias together fit what is left
            s -= 1
        layers.append(nn.Linear(s, s, bias=True))
        left -= (s * s + s) * 4
    return nn.Sequential(*layers)


def _fresh(comm, path: str) -> None:
    """Remove a previous run's output (untimed), so every save writes new files."""
    if comm.Get_rank() == 0 and os.path.isdir(path):
        shutil.rmtree(path)
    elif comm.Get_rank() == 0 and os.path.exists(path):
        os.remove(path)
    comm.Barrier()


def _timed(comm, fn) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def run(mb: int = 400, directory: str = "", repeat: int = 3) -> int:
    """Write and read the same state three ways; print median seconds, GB/s and the ratios.

    Fair by construction: the same tensors and bytes, the same directory, both savers make the
    data durable (hpctrain fsyncs the file before its rename; DCP's FileSystemWriter fsyncs
    every file, sync_files=True) and both split replicated tensors over the ranks (DCP dedups
    them). The two savers alternate ``repeat`` times so a noisy machine hurts both alike.
    """
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
    times: dict[str, list[float]] = {}

    # hpctrain: parallel HDF5, every rank writes its part of each tensor.
    h5 = os.path.join(root, "bench.h5")
    entries = [Entry(f"model/{k}", tuple(t.shape), t.dtype, t) for k, t in sd.items()]

    def read_h5():
        with Reader(h5) as r:
            for e in entries:  # every rank needs the whole replicated state
                r.read(e.name, e.shape)
            r.check()

    # torch.distributed.checkpoint over a gloo group on the same ranks.
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000 if world.rank == 0 else 0))
    os.environ["MASTER_PORT"] = comm.bcast(os.environ["MASTER_PORT"])
    dist.init_process_group("gloo", rank=world.rank, world_size=world.size)
    dcp_dir = os.path.join(root, "dcp")
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    runs = {"hpctrain write": lambda: write_entries(h5, entries, {}, comm),
            "hpctrain read": read_h5,
            "dcp write": lambda: dcp.save(sd, checkpoint_id=dcp_dir),
            "dcp read": lambda: dcp.load(target, checkpoint_id=dcp_dir)}
    for k in range(repeat):
        order = ("hpctrain", "dcp") if k % 2 == 0 else ("dcp", "hpctrain")
        for who in order:
            for what in ("write", "read"):
                name = f"{who} {what}"
                if what == "write":
                    _fresh(comm, h5 if who == "hpctrain" else dcp_dir)
                times.setdefault(name, []).append(_timed(comm, runs[name]))
    dist.destroy_process_group()

    # dd: the same byte count, written (and synced) and read by rank 0 alone.
    raw = os.path.join(root, "dd.bin")
    count = -(-nbytes // 2**20)
    if world.rank == 0:
        for _ in range(repeat):
            t0 = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", f"of={raw}", "bs=1M", f"count={count}",
                            "conv=fdatasync"], check=True, capture_output=True)
            times.setdefault("dd write", []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            subprocess.run(["dd", f"if={raw}", "of=/dev/null", "bs=1M"], check=True,
                           capture_output=True)
            times.setdefault("dd read", []).append(time.perf_counter() - t0)
        res = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        gb = nbytes / 1e9
        print(f"checkpoint bench: {gb:.2f} GB state, {world.size} ranks, dir {root}, "
              f"median of {repeat}, load average {os.getloadavg()[0]:.2f}")
        for k, v in res.items():
            print(f"  {k:<16} {v:7.3f} s  {gb / v:6.2f} GB/s   (all: "
                  f"{' '.join(f'{x:.3f}' for x in times[k])})")
        print(f"  write bandwidth hpctrain/dd = {res['dd write'] / res['hpctrain write']:.2f}x  "
              f"(target >= 0.5)")
        print(f"  save time hpctrain/dcp      = {res['hpctrain write'] / res['dcp write']:.2f}x  "
              f"(target <= 1)")
        print(f"  read time hpctrain/dcp      = {res['hpctrain read'] / res['dcp read']:.2f}x")
        if not directory:
            shutil.rmtree(root, ignore_errors=True)
    comm.Barrier()
    return 0
