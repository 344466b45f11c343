"""No-MPI h5py: one file per rank plus a master file of virtual datasets over them.

Each save writes its rank files into a fresh subdirectory ``ckpt-N.h5.parts/<token>/`` that
only its own master names, so committing is the master's one atomic rename, as in the parallel
path: saving step N again never touches the rank files of the complete ckpt-N.h5 until the
new master has replaced it (then ``drop_unused_parts`` removes the old subdirectory).
"""

from __future__ import annotations

import os
import secrets
import shutil
import warnings

import h5py
import numpy as np

from hpctrain.checkpoint.layout import Entry, block_elems, local_flat, numel, storage_dtype
from hpctrain.checkpoint.writer import (SaveSteps, agree_os_error, agreed_spans, data_end,
                                        fault_hook, finish_attrs, merge_crcs, metadata_room,
                                        new_file, region_crcs, reserve)
from hpctrain.runtime.env import env_flag

__all__ = ["write_serial", "parts_dir", "use_serial", "drop_unused_parts", "FORCE_ENV"]

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


def _used_part(final_path: str) -> str | None:
    """The part subdirectory the master final_path reads: '' none (no master, or not a
    virtual file), '.' the parts directory itself (older masters), None unknown (unreadable)."""
    if not os.path.exists(final_path):
        return ""
    try:
        with h5py.File(final_path, "r", locking=False) as f:
            if f.attrs.get("layout") != "virtual":
                return ""
            return os.path.basename(str(f.attrs.get("parts", ""))) or "."
    except OSError:
        return None


def drop_unused_parts(final_path: str) -> list[str]:
    """Remove the part subdirectories the master final_path does not read; return them.

    Call only while no save of this step runs (holding its claim, or nobody holds it). An
    unreadable master, or one naming a subdirectory that is not there, keeps everything.
    """
    pdir = parts_dir(final_path)
    if not os.path.isdir(pdir):
        return []
    used = _used_part(final_path)
    if used == "":
        shutil.rmtree(pdir, ignore_errors=True)
        return [pdir]
    if used is None or (used != "." and not os.path.isdir(os.path.join(pdir, used))):
        return []
    try:
        names = sorted(os.listdir(pdir))
    except OSError:  # removed meanwhile, or unreadable: nothing to do here
        return []
    removed = [os.path.join(pdir, n) for n in names
               if n != used and os.path.isdir(os.path.join(pdir, n))]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _virtual_dcpl(shape: tuple, sources: list[tuple[str, list, int]], name: str):
    """Creation properties mapping each (file, boxes, size) 1-D part onto its boxes, in order."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    for fname, boxes, size in sources:
        at = 0
        for off, cnt in boxes:
            n = int(np.prod(cnt))
            vspace = h5py.h5s.create_simple(shape)
            vspace.select_hyperslab(tuple(off), tuple(cnt))
            sspace = h5py.h5s.create_simple((size,))
            sspace.select_hyperslab((at,), (n,))
            dcpl.set_virtual(vspace, fname.encode(), name.encode(), sspace)
            at += n
    return dcpl


def _write_parts(path: str, entries: list[Entry], spans, rank: int):
    """Write this rank's flat parts to its own file; (crcs, pieces, scalars, OSError or None)."""
    crcs, pieces, scalars = {}, {}, {}
    try:
        with new_file(path) as f:
            dsets = []
            for i, (e, region) in enumerate(zip(entries, spans)):
                if region.size:
                    flat = local_flat(e, region)
                    if len(e.shape) == 0:  # VDS needs a rank >= 1 selection: in the master
                        scalars[i] = flat.copy()
                    else:
                        dsets.append(f.create_dataset(e.name, data=flat))
                    crcs[i] = region_crcs(flat, region, block_elems(flat.dtype.itemsize))
                    pieces[i] = (region.boxes, region.size)
                fault_hook(rank, i + 1, path)
            reserve(path, data_end(dsets) + metadata_room(entries, {}))  # for the close
    except OSError as exc:  # a full disk: the other ranks must hear of it, not hang
        return crcs, pieces, scalars, exc
    return crcs, pieces, scalars, None


def _new_part_dir(final_path: str, comm) -> str:
    """A fresh subdirectory of final_path's parts directory for this save (collective)."""
    sub = comm.bcast(secrets.token_hex(4) if comm.Get_rank() == 0 else None)
    path = os.path.join(parts_dir(final_path), sub)
    err = None
    if comm.Get_rank() == 0:
        try:
            os.makedirs(path)
        except OSError as exc:
            err = exc
    agree_os_error(comm, err)
    return path


def write_serial(tmp_path: str, final_path: str, entries: list[Entry], root_attrs: dict,
                 comm, steps: SaveSteps | None = None) -> None:
    """Each rank writes its flat parts to its own file; rank 0 writes the master at tmp_path.

    A write error on any rank raises OSError on every rank; one in the master (rank 0 only)
    is left to the caller to agree on. ``steps``: as for write_parallel.
    """
    rank = comm.Get_rank()
    steps = steps or SaveSteps(comm, 0)
    with steps("plan"):
        spans = agreed_spans(entries, comm)
        sub = _new_part_dir(final_path, comm)
    with steps("write"):  # this rank's own file
        crcs, pieces, scalars, err = _write_parts(os.path.join(sub, f"rank-{rank:05d}.h5"),
                                                  entries, spans, rank)
    with steps("agree"):
        agree_os_error(comm, err)
        gathered = comm.allgather((crcs, pieces, scalars))
    merged = merge_crcs([g[0] for g in gathered], entries)
    with steps("master"):  # rank 0's alone: the others wait in the caller's next step
        if rank == 0:
            _write_master(tmp_path, final_path, sub, entries, root_attrs, gathered, merged)


def _write_master(tmp_path, final_path, sub, entries, root_attrs, gathered, merged) -> None:
    # Relative to the master file's directory (the reader sets the prefix).
    rel = os.path.join(os.path.basename(parts_dir(final_path)), os.path.basename(sub))
    with new_file(tmp_path) as f:
        dsets = []
        for i, e in enumerate(entries):
            shape, dt = tuple(e.shape), storage_dtype(e.dtype)
            if numel(shape) == 0:  # nothing to map
                dsets.append(f.create_dataset(e.name, shape=shape, dtype=dt))
            elif len(shape) == 0:
                value = next(g[2][i] for g in gathered if i in g[2])
                dsets.append(f.create_dataset(e.name, data=value.reshape(())))
            else:
                srcs = [(os.path.join(rel, f"rank-{r:05d}.h5"), *g[1][i])
                        for r, g in enumerate(gathered) if i in g[1]]
                f.require_group(os.path.dirname(e.name) or "/")
                h5py.h5d.create(f.id, e.name.encode(), h5py.h5t.py_create(dt),
                                h5py.h5s.create_simple(shape),
                                dcpl=_virtual_dcpl(shape, srcs, e.name))
                dsets.append(f[e.name])
        attrs = {**root_attrs, "layout": "virtual", "parts": rel}
        reserve(tmp_path, data_end(dsets) + metadata_room(entries, attrs)
                + 512 * sum(len(g[1]) for g in gathered))  # the virtual mappings
        finish_attrs(f, dsets, entries, merged, attrs)
