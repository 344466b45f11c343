"""Parts of an N-D dataset as unions of hyperslabs, read or written in one call.

A rank's part of a tensor is a box (an N-D hyperslab: a tensor-parallel row or column
slice, or the whole tensor) and, inside it, a range of its row-major flattened elements (a
ZeRO/FSDP flat shard of that box). Its elements, in row-major order, are both a few N-D
boxes (what HDF5 selects) and a list of runs of the global flattened tensor (what the
checksums of canonical flat blocks are built from)."""

from __future__ import annotations

import h5py
import numpy as np

__all__ = ["flat_boxes", "box_flat_boxes", "box_runs", "select_flat", "select_boxes",
           "write_flat", "write_boxes", "read_flat"]


def flat_boxes(shape: tuple, start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """(offset, count) boxes whose union, in row-major order, is flat elements [start, stop).

    At most 2 * ndim - 1 boxes: a partial first row (recursively), whole rows, a partial last row.
    """
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = int(np.prod(shape[1:], dtype=np.int64))
    (r0, o0), (r1, o1) = divmod(start, inner), divmod(stop, inner)
    if r0 == r1:  # inside one row
        return [((r0,) + off, (1,) + cnt) for off, cnt in flat_boxes(shape[1:], o0, o1)]
    out = []
    if o0:
        out += [((r0,) + off, (1,) + cnt) for off, cnt in flat_boxes(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if o1:
        out += [((r1,) + off, (1,) + cnt) for off, cnt in flat_boxes(shape[1:], 0, o1)]
    return out


def box_flat_boxes(offset: tuple, count: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """(offset, count) boxes whose union, in row-major order, is flat elements [lo, hi) of the
    box (offset, count) of a larger tensor (row-major over the box's own shape)."""
    return [(tuple(o + b for o, b in zip(offset, off)), cnt)
            for off, cnt in flat_boxes(tuple(count), lo, hi)]


def box_runs(shape: tuple, offset: tuple, count: tuple, lo: int = 0,
             hi: int | None = None) -> np.ndarray:
    """(k, 2) int64 [start, stop) runs of the global row-major flattened tensor of ``shape``
    holding flat elements [lo, hi) of the box (offset, count), in order; each run is
    contiguous in the global tensor. A box of whole trailing dims is one run per leading
    index (a row slice: one run; a column slice of a matrix: one run per row)."""
    shape, offset, count = tuple(shape), tuple(offset), tuple(count)
    n = int(np.prod(count, dtype=np.int64))
    hi = n if hi is None else hi
    if hi <= lo or n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    if not shape:
        return np.array([[0, 1]], dtype=np.int64)
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    k = len(shape) - 1  # dims after k are whole: they join the run
    while k > 0 and count[k] == shape[k] and offset[k] == 0:
        k -= 1
    run = count[k] * strides[k]
    starts = np.zeros(1, dtype=np.int64)
    for d in range(k):
        starts = (starts[:, None] + (offset[d] + np.arange(count[d], dtype=np.int64))
                  * strides[d]).reshape(-1)
    starts = starts + offset[k] * strides[k]
    first, last = lo // run, -(-hi // run)
    starts = starts[first:last].copy()
    stops = starts + run
    starts[0] += lo - first * run
    stops[-1] -= last * run - hi
    return np.stack([starts, stops], axis=1)


def select_boxes(space, boxes: list[tuple[tuple, tuple]]) -> None:
    """Select the union of boxes in dataspace space (none when there are none)."""
    if not boxes:
        space.select_none()
        return
    for k, (off, cnt) in enumerate(boxes):
        op = h5py.h5s.SELECT_SET if k == 0 else h5py.h5s.SELECT_OR
        space.select_hyperslab(tuple(off), tuple(cnt), op=op)


def select_flat(space, shape: tuple, start: int, stop: int) -> None:
    """Select flat elements [start, stop) of dataspace space (of shape) in place."""
    if stop <= start:
        space.select_none()
    elif len(shape) == 0 or (start == 0 and stop == int(np.prod(shape, dtype=np.int64))):
        space.select_all()
    else:
        for k, (off, cnt) in enumerate(flat_boxes(tuple(shape), start, stop)):
            op = h5py.h5s.SELECT_SET if k == 0 else h5py.h5s.SELECT_OR
            space.select_hyperslab(off, cnt, op=op)


def _spaces(dset, start: int, stop: int):
    fspace = dset.id.get_space()
    select_flat(fspace, dset.shape, start, stop)
    if dset.ndim == 0 and stop > start:
        return h5py.h5s.create(h5py.h5s.SCALAR), fspace
    mspace = h5py.h5s.create_simple((max(1, stop - start),))
    if stop <= start:
        mspace.select_none()
    return mspace, fspace


def write_boxes(dset, flat: np.ndarray, boxes: list[tuple[tuple, tuple]], dxpl=None) -> None:
    """Write 1-D flat into the union of boxes of dset (row-major order of the union); a rank
    with nothing to write still makes the call (no boxes), as write_flat."""
    if dset.ndim == 0:
        write_flat(dset, flat, 0, len(flat) if boxes else 0, dxpl)
        return
    n = sum(int(np.prod(cnt, dtype=np.int64)) for _, cnt in boxes)
    fspace = dset.id.get_space()
    select_boxes(fspace, boxes if n else [])
    mspace = h5py.h5s.create_simple((max(1, n),))
    if not n:
        mspace.select_none()
        flat = np.empty(1, dtype=dset.dtype)
    dset.id.write(mspace, fspace, np.ascontiguousarray(flat), dxpl=dxpl)


def write_flat(dset, flat: np.ndarray, start: int, stop: int, dxpl=None) -> None:
    """Write 1-D flat into elements [start, stop) of dset.

    Low-level, so a rank with nothing to write still makes the call (a collective write hangs
    if a rank skips it; h5py's high level skips empty selections).
    """
    mspace, fspace = _spaces(dset, start, stop)
    if stop <= start:
        flat = np.empty(1, dtype=dset.dtype)
    elif dset.ndim == 0:
        flat = np.ascontiguousarray(flat).reshape(())
    dset.id.write(mspace, fspace, np.ascontiguousarray(flat), dxpl=dxpl)


def read_flat(dset, start: int, stop: int, dxpl=None) -> np.ndarray:
    """Elements [start, stop) of dset as a 1-D array (0-d for a scalar dataset read whole)."""
    if stop <= start:
        return np.empty(0, dtype=dset.dtype)
    mspace, fspace = _spaces(dset, start, stop)
    out = np.empty(() if dset.ndim == 0 else (stop - start,), dtype=dset.dtype)
    dset.id.read(mspace, fspace, out, dxpl=dxpl)
    return out
