"""Write one checkpoint file with parallel HDF5: each rank writes its part of every tensor."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import time

import h5py
import numpy as np

from hpctrain.checkpoint import meta
from hpctrain.checkpoint.checksum import merge_pieces, piece_crcs
from hpctrain.checkpoint.hyperslab import write_boxes
from hpctrain.checkpoint.layout import (Entry, Region, block_elems, local_flat, numel,
                                        owned_region, storage_dtype)
from hpctrain.checkpoint.writeback import Writeback, libc_function
from hpctrain.runtime.abort import _context, set_context
from hpctrain.runtime.flight import IO_PREFIX, RECORDER, ranks_key

__all__ = ["write_parallel", "fault_hook", "FAULT_ENV", "set_attrs", "dataset_attrs",
           "merge_crcs", "agreed_spans", "region_crcs", "agree_os_error", "finish_attrs", "new_file",
           "reserve", "metadata_room", "data_end", "SaveSteps"]

# Tests only: "RANK:K" makes rank RANK die (os._exit) after writing K datasets of a save;
# "RANK:K:enospc" makes its write fail there as on a full disk; "RANK:K:fill" fills the file
# system there (as another job would), so that the writes after it really fail; "RANK:K:stop"
# stops the rank there (SIGSTOP: a hung file system), writing the time to $STALL_DIR/fault-time.
FAULT_ENV = "HPCTRAIN_CKPT_FAULT"


def fault_hook(rank: int, written: int, path: str = "") -> None:
    """Simulate a rank crashing or its disk filling up in the middle of a save (tests only)."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec:
        r, k, *mode = spec.split(":")
        if int(r) == rank and written == int(k):
            if mode == ["enospc"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if mode == ["fill"]:
                _fill(os.path.join(os.path.dirname(path), ".filler"))
                return
            if mode == ["stop"]:
                if os.environ.get("STALL_DIR"):
                    with open(os.path.join(os.environ["STALL_DIR"], "fault-time"), "w") as f:
                        f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            os._exit(17)


def _fill(path: str) -> None:
    with open(path, "ab", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)


def agree_os_error(comm, exc: OSError | None) -> None:
    """Raise OSError on EVERY rank if any rank's exc is set (collective): errno kept, rank named."""
    mine = None if exc is None else (exc.errno, f"rank {comm.Get_rank()}: {exc.strerror or exc}")
    failed = [x for x in comm.allgather(mine) if x is not None]
    if failed:
        raise OSError(*failed[0])


class SaveSteps:
    """The steps of one save in the flight recorder, in its ``checkpoint`` phase: each is an
    op ``ckpt_<step>`` over the save's ranks (``ckpt[0-N]``, world ranks) with the file's
    size as its bytes, recorded by every rank in the same order (a rank with nothing to do
    in a step records it too), so the watchdog sees a rank that waits in a step for one
    stuck in an earlier one (a hung file system, a stopped process) and names both.

    Used as ``with steps("open"): ...``; ``with steps:`` marks the whole save's phase.
    """

    def __init__(self, comm, nbytes: int):
        try:
            from mpi4py import MPI

            world = MPI.COMM_WORLD.Get_group()
            ranks = comm.Get_group().Translate_ranks(list(range(comm.Get_size())), world)
        except (ImportError, AttributeError):  # a stand-in comm (tests): its own ranks
            ranks = range(comm.Get_size())
        self.key, self.nbytes = ranks_key("ckpt", ranks), int(nbytes)
        self._phase = None

    def __call__(self, step: str):
        return RECORDER.op(self.key, IO_PREFIX + step, self.nbytes)

    def __enter__(self):
        self._phase = _context.get("phase")
        set_context(phase="checkpoint")
        return self

    def __exit__(self, *exc):
        set_context(phase=self._phase)
        return False


def _fds_of(path: str) -> set[int]:
    """This process's descriptors open on path (empty where /proc is not there)."""
    fds, real = set(), os.path.realpath(path)
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(f"/proc/self/fd/{name}") == real:
                fds.add(int(name))
    return fds


def _divert(path: str, fds: set[int]) -> None:
    """Point the descriptors HDF5 (its MPI-IO or POSIX driver) holds on path, a file about to
    be deleted, at an anonymous memory file: the metadata HDF5 flushes when it closes a file
    then has somewhere to go, whatever broke the disk.

    Why this matters: HDF5 1.10 frees a file whose closing flush fails but keeps its id, and
    the next touch of that id (h5py's garbage collection, HDF5's own exit handler) crashes
    the process (a segfault at exit, after the error was reported). A failed H5Fflush is no
    way out either: it leaves the metadata cache unable to close. Where memfd or /proc is
    missing, the file is truncated instead (its data's room is given back for the flush).
    """
    sink = -1
    if fds and hasattr(os, "memfd_create"):
        with contextlib.suppress(OSError):
            sink = os.memfd_create("hpctrain-discarded-checkpoint")
    if sink < 0:
        with contextlib.suppress(OSError):
            os.truncate(path, 0)
        return
    try:
        for fd in fds:
            os.dup2(sink, fd)
    finally:
        os.close(sink)


@contextlib.contextmanager
def new_file(path: str, steps: SaveSteps | None = None, **kwargs):
    """h5py.File(path, "w") whose close raises OSError, as its writes do, when it fails.

    When the block raises, the file is to be deleted: its descriptors are diverted first
    (see ``_divert``), so that closing it cannot fail and crash the process later.
    Closing a file that was written flushes HDF5's cached metadata, into room reserved for
    it beforehand (``reserve``); a failure there is a RuntimeError ("Unable to flush cached
    data"), which callers must see as the write error it is.
    locking=False: rank 0 holds its own lock on a temporary file (see commit.py).
    """
    before = _fds_of(path)
    with steps("open") if steps is not None else contextlib.nullcontext():
        f = h5py.File(path, "w", locking=False, **kwargs)  # collective with MPI-IO
    try:
        yield f
    except BaseException:
        _divert(path, _fds_of(path) - before)
        raise
    finally:
        try:
            with steps("close") if steps is not None else contextlib.nullcontext():
                f.close()  # collective with MPI-IO
        except RuntimeError as exc:
            raise OSError(None, f"closing {path}: {exc}") from exc


_FALLOC_FL_KEEP_SIZE = 1


_FALLOCATE = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                         ctypes.c_int64])


def reserve(path: str, nbytes: int) -> None:
    """Allocate the blocks of path's first nbytes without changing its size, so that the
    metadata HDF5 writes when the file closes cannot meet a full disk (OSError ENOSPC here,
    where the save can still fail cleanly). A no-op where the file system cannot."""
    if _FALLOCATE is None:
        return
    fd = os.open(path, os.O_WRONLY)
    try:
        if _FALLOCATE(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) != 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC or err == errno.EDQUOT:
                raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def metadata_room(entries: list[Entry], attrs: dict) -> int:
    """Bytes of metadata a file may still add when its attributes are written and it closes:
    a checksum table per dataset and the root attributes, with a margin."""
    crcs = sum(8 * (numel(tuple(e.shape)) // max(block_elems(storage_dtype(e.dtype).itemsize), 1)
                    + 1) for e in entries)
    text = sum(len(v) if isinstance(v, (str, bytes)) else 64 for v in attrs.values())
    return 64 * 1024 + 4 * 1024 * len(entries) + crcs + 2 * text


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
            fault_hook(rank, i + 1, path)
    except OSError as exc:  # a full disk: the other ranks must hear of it, not hang
        return crcs, exc
    finally:
        wb.close()
    return crcs, None


def data_end(dsets) -> int:
    """The end of the last dataset's storage in the file (what is allocated so far)."""
    ends = [0]
    for d in dsets:
        offset = d.id.get_offset()  # None: no storage of its own (empty, or in its header)
        if offset is not None:
            ends.append(offset + d.id.get_storage_size())
    return max(ends)


def write_parallel(path: str, entries: list[Entry], root_attrs: dict, comm,
                   steps: SaveSteps | None = None) -> None:
    """Write entries and root attributes into path (collective over comm; path is overwritten).

    Data is written with INDEPENDENT I/O: a rank's part of a contiguous dataset is one contiguous
    extent of the file, so collective buffering only adds an exchange between ranks (measured
    about 2x slower at 2 ranks with both ompio and romio321, see `hpctrain bench checkpoint`).
    Creating datasets and attributes stays collective, as HDF5 requires. ``steps``: where
    the flight recorder sees the save (SaveSteps; made here when not given).
    """
    steps = steps or SaveSteps(comm, 0)
    with steps("plan"):
        spans = agreed_spans(entries, comm)
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_INDEPENDENT)
    with new_file(path, steps, driver="mpio", comm=comm) as f:
        with steps("create"):  # collective, as every change of HDF5 metadata
            # Contiguous datasets, never filled: every byte is written by exactly one rank.
            dsets = [f.create_dataset(e.name, shape=tuple(e.shape),
                                      dtype=storage_dtype(e.dtype), fill_time="never")
                     for e in entries]
        with steps("write"):  # this rank's own part: no other rank involved
            crcs, err = _write_data(path, entries, dsets, spans, dxpl, comm.Get_rank())
            if err is None and comm.Get_rank() == 0:  # room for what closing the file writes
                try:
                    reserve(path, data_end(dsets) + metadata_room(entries, root_attrs))
                except OSError as exc:
                    err = exc
        with steps("agree"):
            agree_os_error(comm, err)  # all ranks leave (and close the file) together
        with steps("attrs"):
            finish_attrs(f, dsets, entries, merge_crcs(comm.allgather(crcs), entries),
                         root_attrs)
