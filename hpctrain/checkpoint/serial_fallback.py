"""No-MPI h5py: one file per rank plus a master file of virtual datasets over them."""

from __future__ import annotations

import os
import shutil
import warnings

import h5py
import numpy as np

from hpctrain.checkpoint.checksum import piece_crcs
from hpctrain.checkpoint.hyperslab import flat_boxes
from hpctrain.checkpoint.layout import Entry, block_elems, local_flat, numel, storage_dtype
from hpctrain.checkpoint.writer import (agreed_spans, dataset_attrs, fault_hook, merge_crcs,
                                        set_attrs)
from hpctrain.runtime.env import env_flag

__all__ = ["write_serial", "parts_dir", "use_serial", "FORCE_ENV"]

FORCE_ENV = "HPCTRAIN_CKPT_FORCE_SERIAL"
_warned = False


def use_serial(rank: int) -> bool:
    """True when h5py lacks MPI (or tests force it); rank 0 warns once per process."""
    global _warned
    serial = env_flag(FORCE_ENV) or not h5py.get_config().mpi
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


def _virtual_dcpl(shape: tuple, sources: list[tuple[str, int, int]], name: str):
    """Creation properties mapping each (file, start, stop) 1-D part onto its flat range."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    for fname, lo, hi in sources:
        at = 0
        for off, cnt in flat_boxes(shape, lo, hi):
            n = int(np.prod(cnt))
            vspace = h5py.h5s.create_simple(shape)
            vspace.select_hyperslab(off, cnt)
            sspace = h5py.h5s.create_simple((hi - lo,))
            sspace.select_hyperslab((at,), (n,))
            dcpl.set_virtual(vspace, fname.encode(), name.encode(), sspace)
            at += n
    return dcpl


def write_serial(tmp_path: str, final_path: str, entries: list[Entry], root_attrs: dict,
                 comm) -> None:
    """Each rank writes its flat parts to its own file; rank 0 writes the master at tmp_path."""
    rank = comm.Get_rank()
    spans = agreed_spans(entries, comm)
    pdir = parts_dir(final_path)
    if rank == 0:
        shutil.rmtree(pdir, ignore_errors=True)  # a stale one from a crashed save
        os.makedirs(pdir)
    comm.Barrier()
    crcs, pieces, scalars = {}, {}, {}
    with h5py.File(os.path.join(pdir, f"rank-{rank:05d}.h5"), "w") as f:
        for i, (e, span) in enumerate(zip(entries, spans)):
            if span[1] <= span[0]:
                continue
            flat = local_flat(e, span)
            if len(e.shape) == 0:  # VDS needs a rank >= 1 selection; scalars go in the master
                scalars[i] = flat.copy()
            else:
                f.create_dataset(e.name, data=flat)
            crcs[i] = piece_crcs(flat, span[0], block_elems(flat.dtype.itemsize))
            pieces[i] = span
            fault_hook(rank, i + 1)
    gathered = comm.allgather((crcs, pieces, scalars))
    merged = merge_crcs([g[0] for g in gathered], entries)
    if rank != 0:
        return
    with h5py.File(tmp_path, "w") as f:
        for i, e in enumerate(entries):
            shape, dt = tuple(e.shape), storage_dtype(e.dtype)
            if numel(shape) == 0:  # nothing to map
                d = f.create_dataset(e.name, shape=shape, dtype=dt)
            elif len(shape) == 0:
                value = next(g[2][i] for g in gathered if i in g[2])
                d = f.create_dataset(e.name, data=value.reshape(()))
            else:
                # Relative to the master file's directory (the reader sets the prefix).
                srcs = [(os.path.join(os.path.basename(pdir), f"rank-{r:05d}.h5"), *g[1][i])
                        for r, g in enumerate(gathered) if i in g[1]]
                f.require_group(os.path.dirname(e.name) or "/")
                h5py.h5d.create(f.id, e.name.encode(), h5py.h5t.py_create(dt),
                                h5py.h5s.create_simple(shape),
                                dcpl=_virtual_dcpl(shape, srcs, e.name))
                d = f[e.name]
            set_attrs(d, dataset_attrs(e, dt.itemsize, merged[i]))
        set_attrs(f, {**root_attrs, "layout": "virtual"})
