"""What a strategy tells the checkpoint: per tensor, its global name/shape/dtype and owned part."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Entry", "to_numpy", "from_numpy", "storage_dtype", "BLOCK_BYTES", "block_elems",
           "numel", "owned_elems", "local_flat", "replicated_elems"]

# Canonical checksum block: a fixed byte budget of the row-major flattened tensor, independent
# of the world size and of how it is sharded, so CRCs written by N ranks verify when M read.
BLOCK_BYTES = 4 << 20

# torch dtypes numpy lacks are stored as same-width integers; the dataset's `torch_dtype`
# attribute says how to view them back.
_VIEW = {torch.bfloat16: torch.int16}


@dataclass
class Entry:
    """One tensor of the checkpoint.

    ``name``: dataset path (e.g. ``model/fc.weight``); ``shape``/``dtype``: GLOBAL ones;
    ``local``: this rank's tensor; ``rows``: the (start, stop) rows of the global tensor that
    ``local`` holds; ``elems``: instead, the (start, stop) elements of the row-major flattened
    global tensor that the 1-D ``local`` holds (ZeRO/FSDP flat shards, any alignment); both None
    when every rank holds all of it (replicated: the writer splits the writing over ranks);
    ``load``: called with the numpy array read back for ``rows``.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    local: torch.Tensor | None
    rows: tuple | None = None
    load: object = None
    elems: tuple | None = None


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
    a = np.asarray(a)
    t = torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape))  # keeps 0-d as 0-d
    return t.view(dtype) if dtype in _VIEW else t


def numel(shape: tuple) -> int:
    """Elements of a global shape (a scalar has one)."""
    return int(np.prod(shape, dtype=np.int64))


def block_elems(itemsize: int) -> int:
    """Elements per canonical checksum block of a dataset of this item size."""
    return max(1, BLOCK_BYTES // itemsize)


def replicated_elems(index: int, shape: tuple, itemsize: int, rank: int, world: int) -> tuple:
    """Flat elements this rank writes of the index-th replicated tensor.

    Whole checksum blocks are split contiguously over ranks so every rank writes (and
    checksums) its own blocks in parallel; the split starts at a rank rotated by ``index`` so
    the many one-block tensors (biases, norms) are spread over ranks instead of all on rank 0.
    """
    n, b = numel(shape), block_elems(itemsize)
    nblocks = -(-n // b)
    pos = (rank - index) % world
    lo, hi = pos * nblocks // world, (pos + 1) * nblocks // world
    return min(lo * b, n), min(hi * b, n)


def owned_elems(index: int, e: Entry, rank: int, world: int) -> tuple:
    """The (start, stop) flat elements of e's global tensor that this rank writes."""
    shape, n = tuple(e.shape), numel(tuple(e.shape))
    if e.rows is not None and e.elems is not None:
        raise ValueError(f"{e.name}: Entry has both rows={tuple(e.rows)} and "
                         f"elems={tuple(e.elems)}; give one of them")
    if e.elems is not None:
        start, stop = (int(x) for x in e.elems)
        span = f"elements {(start, stop)}"
    elif e.rows is not None:
        inner = numel(shape[1:]) if shape else 1
        start, stop = int(e.rows[0]) * inner, int(e.rows[1]) * inner
        span = f"rows {tuple(e.rows)}"
    else:
        return replicated_elems(index, shape, storage_dtype(e.dtype).itemsize, rank, world)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"{e.name}: owned {span} lie outside the tensor of shape {shape} "
                         f"({n} elements); give a range within it")
    have = 0 if e.local is None else e.local.numel()
    if have != stop - start:
        raise ValueError(f"{e.name}: owned {span} hold {stop - start} elements but `local` "
                         f"has {have}; pass exactly the owned part (no padding)")
    return start, stop


def local_flat(e: Entry, span: tuple) -> np.ndarray:
    """This rank's flat elements span of e as a 1-D numpy array (no copy when contiguous)."""
    if e.local is None:  # owns nothing of a sharded tensor
        return np.empty(0, dtype=storage_dtype(e.dtype))
    a = to_numpy(e.local).reshape(-1)
    if e.rows is None and e.elems is None:
        return a[span[0]:span[1]]  # replicated: every rank holds all, writes its part
    return a
