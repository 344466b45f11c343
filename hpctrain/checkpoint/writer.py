"""Write one checkpoint file with parallel HDF5: every rank writes its rows, collectively."""

from __future__ import annotations

import os

import h5py
import numpy as np

from hpctrain.checkpoint.checksum import block_crcs
from hpctrain.checkpoint.layout import (Entry, block_rows, num_rows, replicated_rows,
                                        storage_dtype, to_numpy)

__all__ = ["write_parallel", "owned_rows", "fault_hook", "FAULT_ENV", "set_attrs"]

# Tests only: "RANK:K" makes rank RANK die (os._exit) after writing K datasets of a save.
FAULT_ENV = "HPCTRAIN_CKPT_FAULT"


def fault_hook(rank: int, written: int) -> None:
    """Simulate a rank crashing in the middle of a save (enabled by FAULT_ENV, tests only)."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec:
        r, k = (int(x) for x in spec.split(":"))
        if r == rank and written == k:
            os._exit(17)


def owned_rows(index: int, e: Entry, rank: int, world: int) -> tuple:
    """The (start, stop) rows this rank writes of entry e."""
    if e.rows is not None:
        brows = block_rows(tuple(e.shape), storage_dtype(e.dtype).itemsize)
        if e.rows[0] % brows or (e.rows[1] % brows and e.rows[1] != num_rows(tuple(e.shape))):
            raise ValueError(f"{e.name}: owned rows {tuple(e.rows)} do not start and end on "
                             f"checksum blocks of {brows} rows; shard on block boundaries "
                             f"(layout.block_rows) so each block is checksummed by one rank")
        return tuple(e.rows)
    return replicated_rows(index, tuple(e.shape), storage_dtype(e.dtype).itemsize, rank, world)


def local_part(e: Entry, rows: tuple) -> np.ndarray:
    """This rank's rows of e as a numpy array (replicated entries are sliced here)."""
    a = to_numpy(e.local)
    if e.rows is None and a.ndim:
        return a[rows[0]:rows[1]]
    return a


def set_attrs(obj, attrs: dict) -> None:
    """Write attributes in sorted order (creation is collective: same order on every rank)."""
    for k in sorted(attrs):
        obj.attrs[k] = attrs[k]


def _write_rows(dset, arr: np.ndarray, rows: tuple, dxpl) -> None:
    # Low-level write so a rank with nothing to write still joins the collective call
    # (h5py's high level skips empty selections, which would hang the others).
    fspace = dset.id.get_space()
    shape = dset.shape
    n = rows[1] - rows[0]
    if n <= 0:
        fspace.select_none()
        mspace = h5py.h5s.create_simple((1,))
        mspace.select_none()
        arr = np.empty(1, dtype=dset.dtype)
    elif len(shape) == 0:
        mspace = h5py.h5s.create(h5py.h5s.SCALAR)
    else:
        fspace.select_hyperslab((rows[0],) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))
        mspace = h5py.h5s.create_simple(arr.shape)
    dset.id.write(mspace, fspace, np.ascontiguousarray(arr), dxpl=dxpl)


def write_parallel(path: str, entries: list[Entry], root_attrs: dict, comm) -> None:
    """Write entries and root attributes into path (collective over comm; path is overwritten)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    with h5py.File(path, "w", driver="mpio", comm=comm) as f:
        # Contiguous datasets, never filled: every byte is written by exactly one rank.
        dsets = [f.create_dataset(e.name, shape=tuple(e.shape), dtype=storage_dtype(e.dtype),
                                  fill_time="never") for e in entries]
        crcs = {}
        for i, (e, d) in enumerate(zip(entries, dsets)):
            rows = owned_rows(i, e, rank, world)
            part = local_part(e, rows) if rows[1] > rows[0] else None
            _write_rows(d, part, rows, dxpl)
            if part is not None:
                crcs[i] = block_crcs(part, rows[0], block_rows(d.shape, d.dtype.itemsize))
            fault_hook(rank, i + 1)
        merged = _merge_crcs(comm.allgather(crcs), entries)
        for i, (e, d) in enumerate(zip(entries, dsets)):
            set_attrs(d, dataset_attrs(e, d.shape, d.dtype.itemsize, merged[i]))
        set_attrs(f, root_attrs)


def dataset_attrs(e: Entry, shape: tuple, itemsize: int, crcs: np.ndarray) -> dict:
    """The attributes every tensor dataset carries."""
    return {"crc32": crcs, "crc_block_rows": np.int64(block_rows(shape, itemsize)),
            "torch_dtype": str(e.dtype).replace("torch.", "")}


def _merge_crcs(gathered: list[dict], entries: list[Entry]) -> list[np.ndarray]:
    out = []
    for i, e in enumerate(entries):
        blocks = {}
        for per_rank in gathered:
            blocks.update(per_rank.get(i, {}))
        n = num_rows(tuple(e.shape))
        out.append(np.array([blocks[b] for b in sorted(blocks)], dtype=np.uint32)
                   if n else np.zeros(0, dtype=np.uint32))
    return out
