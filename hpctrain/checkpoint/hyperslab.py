"""A flat element range of an N-D dataset as a union of hyperslabs, read or written in one call."""

from __future__ import annotations

import h5py
import numpy as np

__all__ = ["flat_boxes", "select_flat", "write_flat", "read_flat"]


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
