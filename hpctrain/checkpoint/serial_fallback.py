"""No-MPI h5py: one file per rank plus a master file of virtual datasets over them."""

from __future__ import annotations

import os
import shutil
import warnings

import h5py
import numpy as np

from hpctrain.checkpoint.checksum import block_crcs
from hpctrain.checkpoint.layout import Entry, block_rows, storage_dtype
from hpctrain.checkpoint.writer import (dataset_attrs, fault_hook, local_part, owned_rows,
                                        set_attrs, _merge_crcs)

__all__ = ["write_serial", "parts_dir", "use_serial", "FORCE_ENV"]

FORCE_ENV = "HPCTRAIN_CKPT_FORCE_SERIAL"
_warned = False


def use_serial(rank: int) -> bool:
    """True when h5py lacks MPI (or tests force it); rank 0 warns once per process."""
    global _warned
    serial = os.environ.get(FORCE_ENV, "") not in ("", "0") or not h5py.get_config().mpi
    if serial and rank == 0 and not _warned:
        _warned = True
        warnings.warn("hpctrain: h5py has no MPI support (or HPCTRAIN_CKPT_FORCE_SERIAL is set): "
                      "checkpoints are written as one file per rank plus a master file of "
                      "virtual datasets; rebuild h5py with HDF5_MPI=ON for one parallel file",
                      RuntimeWarning, stacklevel=2)
    return serial


def parts_dir(final_path: str) -> str:
    """Directory holding the per-rank files of the checkpoint final_path."""
    return final_path + ".parts"


def write_serial(tmp_path: str, final_path: str, entries: list[Entry], root_attrs: dict, comm) -> None:
    """Each rank writes its rows to its own file; rank 0 writes the master file at tmp_path."""
    rank, world = comm.Get_rank(), comm.Get_size()
    pdir = parts_dir(final_path)
    if rank == 0:
        shutil.rmtree(pdir, ignore_errors=True)  # a stale one from a crashed save
        os.makedirs(pdir)
    comm.Barrier()
    part_name = f"rank-{rank:05d}.h5"
    crcs, pieces = {}, {}
    with h5py.File(os.path.join(pdir, part_name), "w") as f:
        for i, e in enumerate(entries):
            rows = owned_rows(i, e, rank, world)
            if rows[1] <= rows[0]:
                continue
            part = local_part(e, rows)
            f.create_dataset(e.name, data=part)
            crcs[i] = block_crcs(part, rows[0], block_rows(tuple(e.shape), part.dtype.itemsize))
            pieces[i] = rows
            fault_hook(rank, i + 1)
    gathered = comm.allgather((crcs, pieces))
    merged = _merge_crcs([g[0] for g in gathered], entries)
    if rank == 0:
        with h5py.File(tmp_path, "w") as f:
            for i, e in enumerate(entries):
                shape, dt = tuple(e.shape), storage_dtype(e.dtype)
                if len(shape) == 0:  # VDS needs a rank >= 1 selection; scalars are tiny
                    d = f.create_dataset(e.name, data=local_part(e, (0, 1)))
                else:
                    layout = h5py.VirtualLayout(shape=shape, dtype=dt)
                    for r, (_, pcs) in enumerate(gathered):
                        if i in pcs:
                            lo, hi = pcs[i]
                            # Relative to the master file's directory (see reader.open_checkpoint).
                            src = h5py.VirtualSource(
                                os.path.join(os.path.basename(pdir), f"rank-{r:05d}.h5"),
                                e.name, shape=(hi - lo,) + shape[1:])
                            layout[lo:hi] = src
                    d = f.create_virtual_dataset(e.name, layout, fillvalue=None)
                set_attrs(d, dataset_attrs(e, shape, dt.itemsize, merged[i]))
            set_attrs(f, {**root_attrs, "layout": "virtual"})
