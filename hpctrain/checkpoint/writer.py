"""Write one checkpoint file with parallel HDF5: each rank writes its part of every tensor."""

from __future__ import annotations

import contextlib
import errno
import os

import h5py
import numpy as np

from hpctrain.checkpoint import meta
from hpctrain.checkpoint.checksum import merge_pieces, piece_crcs
from hpctrain.checkpoint.hyperslab import write_boxes
from hpctrain.checkpoint.layout import (Entry, Region, block_elems, local_flat, numel,
                                        owned_region, storage_dtype)
from hpctrain.checkpoint.writeback import Writeback

__all__ = ["write_parallel", "fault_hook", "FAULT_ENV", "set_attrs", "dataset_attrs",
           "merge_crcs", "agreed_spans", "region_crcs", "agree_os_error", "finish_attrs", "new_file"]

# Tests only: "RANK:K" makes rank RANK die (os._exit) after writing K datasets of a save;
# "RANK:K:enospc" makes its write fail there as on a full disk.
FAULT_ENV = "HPCTRAIN_CKPT_FAULT"


def fault_hook(rank: int, written: int) -> None:
    """Simulate a rank crashing or its disk filling up in the middle of a save (tests only)."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec:
        r, k, *mode = spec.split(":")
        if int(r) == rank and written == int(k):
            if mode == ["enospc"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os._exit(17)


def agree_os_error(comm, exc: OSError | None) -> None:
    """Raise OSError on EVERY rank if any rank's exc is set (collective): errno kept, rank named."""
    mine = None if exc is None else (exc.errno, f"rank {comm.Get_rank()}: {exc.strerror or exc}")
    failed = [x for x in comm.allgather(mine) if x is not None]
    if failed:
        raise OSError(*failed[0])


@contextlib.contextmanager
def new_file(path: str, **kwargs):
    """h5py.File(path, "w") whose close raises OSError, as its writes do, when it fails.

    Closing flushes HDF5's cached metadata: into a full disk that fails with a RuntimeError
    ("Unable to flush cached data"), which callers must see as the write error it is.
    locking=False: rank 0 holds its own lock on a temporary file (see commit.py).
    """
    f = h5py.File(path, "w", locking=False, **kwargs)
    try:
        yield f
    except OSError:
        # The file will be deleted: give its space back first, so that the flush at close has
        # room (a flush that fails again can hang a parallel close, or crash at exit).
        with contextlib.suppress(OSError):
            os.truncate(path, 0)
        raise
    finally:
        try:
            f.close()
        except RuntimeError as exc:
            raise OSError(None, f"closing {path}: {exc}") from exc


def set_attrs(obj, attrs: dict) -> None:
    """Write attributes in sorted order (creation is collective: same order on every rank)."""
    for k in sorted(attrs):
        obj.attrs[k] = attrs[k]


def dataset_attrs(e: Entry, itemsize: int, crcs: np.ndarray) -> dict:
    """The attributes every tensor dataset carries."""
    return {"crc32": crcs, "crc_block_elems": np.int64(block_elems(itemsize)),
            "torch_dtype": str(e.dtype).replace("torch.", "")}


def merge_crcs(gathered: list[dict], entries: list[Entry]) -> list[np.ndarray]:
    """Per entry, the block CRCs combined from every rank's {entry index: pieces}."""
    out = []
    for i, e in enumerate(entries):
        pieces = [p for per_rank in gathered for p in per_rank.get(i, ())]
        size = storage_dtype(e.dtype).itemsize
        out.append(merge_pieces(pieces, numel(tuple(e.shape)), block_elems(size), size, e.name))
    return out


def region_crcs(flat: np.ndarray, region: Region, belems: int) -> list:
    """Checksum pieces of this rank's elements: each global run's pieces of the blocks."""
    out, at = [], 0
    for start, stop in region.runs.tolist():
        out += piece_crcs(flat[at:at + stop - start], start, belems)
        at += stop - start
    return out


def agreed_spans(entries: list[Entry], comm) -> list[Region]:
    """This rank's owned regions; a bad Entry on any rank raises on every rank (no hang)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    try:
        spans, err = [owned_region(i, e, rank, world) for i, e in enumerate(entries)], None
    except ValueError as exc:
        spans, err = [], f"rank {rank}: {exc}"
    errors = [x for x in comm.allgather(err) if x]
    if errors:
        raise ValueError(errors[0])
    return spans


def finish_attrs(f, dsets, entries: list[Entry], crcs: list[np.ndarray], root_attrs: dict) -> None:
    """Write every dataset's and the root's attributes, then seal them with their checksum."""
    for e, d, c in zip(entries, dsets, crcs):
        set_attrs(d, dataset_attrs(e, d.dtype.itemsize, c))
    set_attrs(f, root_attrs)
    meta.seal(f)


def _write_data(path: str, entries: list[Entry], dsets, spans, dxpl, rank: int):
    """Write this rank's part of every dataset; (its CRC pieces, the OSError that stopped it)."""
    crcs = {}
    wb = Writeback(path)
    try:
        for i, (e, d, region) in enumerate(zip(entries, dsets, spans)):
            if region.size:
                flat = local_flat(e, region)
                write_boxes(d, flat, region.boxes, dxpl)
                size = d.dtype.itemsize
                if d.ndim:  # a scalar may live in HDF5's object header: no offset
                    start, stop = int(region.runs[0, 0]), int(region.runs[-1, 1])
                    wb.start(d.id.get_offset() + start * size, (stop - start) * size)
                crcs[i] = region_crcs(flat, region, block_elems(size))
            fault_hook(rank, i + 1)
    except OSError as exc:  # a full disk: the other ranks must hear of it, not hang
        return crcs, exc
    finally:
        wb.close()
    return crcs, None


def write_parallel(path: str, entries: list[Entry], root_attrs: dict, comm) -> None:
    """Write entries and root attributes into path (collective over comm; path is overwritten).

    Data is written with INDEPENDENT I/O: a rank's part of a contiguous dataset is one contiguous
    extent of the file, so collective buffering only adds an exchange between ranks (measured
    about 2x slower at 2 ranks with both ompio and romio321, see `hpctrain bench checkpoint`).
    Creating datasets and attributes stays collective, as HDF5 requires.
    """
    spans = agreed_spans(entries, comm)
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_INDEPENDENT)
    with new_file(path, driver="mpio", comm=comm) as f:
        # Contiguous datasets, never filled: every byte is written by exactly one rank.
        dsets = [f.create_dataset(e.name, shape=tuple(e.shape), dtype=storage_dtype(e.dtype),
                                  fill_time="never") for e in entries]
        crcs, err = _write_data(path, entries, dsets, spans, dxpl, comm.Get_rank())
        agree_os_error(comm, err)  # all ranks leave (and close the file) together
        finish_attrs(f, dsets, entries, merge_crcs(comm.allgather(crcs), entries), root_attrs)
