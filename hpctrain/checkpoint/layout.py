"""What a strategy tells the checkpoint: per tensor, its global name/shape/dtype and owned rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Entry", "to_numpy", "from_numpy", "storage_dtype", "BLOCK_BYTES", "block_rows",
           "num_rows", "replicated_rows"]

# Canonical checksum block: a fixed byte budget, independent of the world size, so CRCs
# written by N ranks verify when M ranks read.
BLOCK_BYTES = 4 << 20

# torch dtypes numpy lacks are stored as same-width integers; the dataset's `torch_dtype`
# attribute says how to view them back.
_VIEW = {torch.bfloat16: torch.int16}


@dataclass
class Entry:
    """One tensor of the checkpoint.

    ``name``: dataset path (e.g. ``model/fc.weight``); ``shape``/``dtype``: GLOBAL ones;
    ``local``: this rank's tensor; ``rows``: the (start, stop) rows of the global tensor that
    ``local`` holds, or None when every rank holds all of it (replicated: the writer splits the
    writing over ranks); ``load``: called with the numpy array read back for ``rows``.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    local: torch.Tensor | None
    rows: tuple | None = None
    load: object = None


def storage_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a torch dtype is stored as."""
    return torch.empty((), dtype=_VIEW.get(dtype, dtype)).numpy().dtype


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU numpy view of t (bf16 viewed as int16)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype in _VIEW:
        t = t.view(_VIEW[t.dtype])
    return np.ascontiguousarray(t.numpy()).reshape(tuple(t.shape))  # keeps 0-d as 0-d


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A torch tensor of dtype from an array read from the file."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(dtype) if dtype in _VIEW else t


def num_rows(shape: tuple) -> int:
    """Rows of a global shape (a scalar is one row)."""
    return int(shape[0]) if len(shape) else 1


def block_rows(shape: tuple, itemsize: int) -> int:
    """Rows per canonical checksum block of a dataset of this shape."""
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize if len(shape) else itemsize
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def replicated_rows(index: int, shape: tuple, itemsize: int, rank: int, world: int) -> tuple:
    """Rows this rank writes of the index-th replicated tensor.

    Whole checksum blocks are split contiguously over ranks so every rank writes (and
    checksums) its own blocks in parallel; the split starts at a rank rotated by ``index`` so
    the many one-block tensors (biases, norms) are spread over ranks instead of all on rank 0.
    """
    n, b = num_rows(shape), block_rows(shape, itemsize)
    nblocks = -(-n // b) if n else 0
    pos = (rank - index) % world
    lo, hi = pos * nblocks // world, (pos + 1) * nblocks // world
    return min(lo * b, n), min(hi * b, n)
