"""What a strategy tells the checkpoint: per tensor, its global name/shape/dtype and owned part."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Entry", "Region", "to_numpy", "from_numpy", "storage_dtype", "BLOCK_BYTES",
           "block_elems", "box_parts", "numel", "owned_region", "local_flat", "replicated_elems"]

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
    ``local``: this rank's tensor. What part of the global tensor it holds:

    - ``box=(offset, count)``: an N-D hyperslab (a tensor-parallel slice along any dim; ``local``
      has shape ``count``); ``box=(offset, count, view)``: that box of the tensor seen as
      the shape ``view`` (same elements, row-major), e.g. a fused qkv weight's whole heads;
    - ``rows=(start, stop)``: the box of those whole rows;
    - ``elems=(start, stop)``: the 1-D ``local`` holds those elements of the row-major
      flattened tensor (ZeRO/FSDP flat shards, any alignment) or, with ``box``, of the
      flattened box (a flat shard of a tensor-parallel slice);
    - none of them: every rank holds all of it (replicated: the writer splits the writing).

    ``load``: called with the numpy array read back for ``rows``.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    local: torch.Tensor | None
    rows: tuple | None = None
    load: object = None
    elems: tuple | None = None
    box: tuple | None = None


@dataclass(frozen=True)
class Region:
    """The elements one rank writes of an entry, in row-major order: as N-D ``boxes`` (HDF5
    selections), as ``runs`` of the global flattened tensor ((k, 2) [start, stop) rows:
    checksum pieces) and, for a replicated entry, the ``part`` of the local tensor's flat
    elements they are (None: all of ``local``)."""

    boxes: list
    runs: np.ndarray
    part: tuple | None = None

    @property
    def size(self) -> int:
        return int((self.runs[:, 1] - self.runs[:, 0]).sum()) if len(self.runs) else 0


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


def _flat_region(shape: tuple, start: int, stop: int, part=None) -> Region:
    from hpctrain.checkpoint.hyperslab import flat_boxes

    runs = np.array([[start, stop]] if stop > start else [], dtype=np.int64).reshape(-1, 2)
    boxes = flat_boxes(shape, start, stop) if shape else ([((), ())] if stop > start else [])
    return Region(boxes, runs, part)


def owned_region(index: int, e: Entry, rank: int, world: int) -> Region:
    """The part of e's global tensor this rank writes (its own part; a replicated entry: its
    share of the writing). Raises ValueError naming the entry when the part does not fit."""
    from hpctrain.checkpoint.hyperslab import box_flat_boxes, box_runs

    shape, n = tuple(e.shape), numel(tuple(e.shape))
    given = [k for k in ("rows", "box") if getattr(e, k) is not None]
    if len(given) > 1:
        raise ValueError(f"{e.name}: Entry has both rows={tuple(e.rows)} and box={tuple(e.box)}; "
                         f"give one of them")
    if not given and e.elems is None:
        start, stop = replicated_elems(index, shape, storage_dtype(e.dtype).itemsize, rank, world)
        return _flat_region(shape, start, stop, (start, stop))
    if e.rows is not None:
        a, b = int(e.rows[0]), int(e.rows[1])
        if not 0 <= a <= b <= (shape[0] if shape else 0):
            raise ValueError(f"{e.name}: owned rows {(a, b)} lie outside the tensor of shape "
                             f"{shape}; give a range within it")
        box = ((a,) + (0,) * (len(shape) - 1), (b - a,) + shape[1:])
        span = f"rows {(a, b)}"
    elif e.box is not None:
        off, cnt, view = box_parts(e.box, shape)
        if view != shape and numel(view) != n:
            raise ValueError(f"{e.name}: box view {view} has {numel(view)} elements, the "
                             f"tensor of shape {shape} {n}; give a view of the same elements")
        if len(off) != len(view) or len(cnt) != len(view) or any(
                o < 0 or c < 0 or o + c > s for o, c, s in zip(off, cnt, view)):
            raise ValueError(f"{e.name}: owned box offset {off} count {cnt} lies outside the "
                             f"tensor of shape {view}; give a box within it")
        box, span = (off, cnt), f"box offset {off} count {cnt}"
    else:
        box, span = (((0,) * len(shape), shape)), None
    inner = numel(box[1])
    if e.elems is not None:
        lo, hi = (int(x) for x in e.elems)
        within = f" of the box (offset {box[0]}, count {box[1]})" if span else ""
        if not 0 <= lo <= hi <= inner:
            raise ValueError(f"{e.name}: owned elements {(lo, hi)}{within} lie outside the "
                             f"tensor of shape {shape} ({n} elements); give a range within it")
        span = f"elements {(lo, hi)}{within}"
    else:
        lo, hi = 0, inner
    have = 0 if e.local is None else e.local.numel()
    if have != hi - lo:
        raise ValueError(f"{e.name}: owned {span} hold {hi - lo} elements but `local` has "
                         f"{have}; pass exactly the owned part (no padding)")
    if not shape:
        return _flat_region(shape, lo, hi)
    if e.box is not None and len(e.box) == 3 and tuple(e.box[2]) != shape:
        # A box of a view: its runs of the flattened tensor, each as boxes of the dataset.
        from hpctrain.checkpoint.hyperslab import flat_boxes

        runs = box_runs(tuple(int(x) for x in e.box[2]), box[0], box[1], lo, hi)
        return Region([b for a, z in runs.tolist() for b in flat_boxes(shape, a, z)], runs)
    return Region(box_flat_boxes(box[0], box[1], lo, hi) if hi > lo else [],
                  box_runs(shape, box[0], box[1], lo, hi))


def box_parts(box: tuple, shape: tuple) -> tuple:
    """(offset, count, view shape) of an Entry/read box: (offset, count) is a box of the
    tensor's own shape, (offset, count, view) one of the view."""
    off, cnt = (tuple(int(x) for x in v) for v in box[:2])
    view = tuple(int(x) for x in box[2]) if len(box) > 2 else tuple(shape)
    return off, cnt, view


def local_flat(e: Entry, region: Region) -> np.ndarray:
    """This rank's written elements of e as a 1-D numpy array (no copy when contiguous)."""
    if e.local is None:  # owns nothing of a sharded tensor
        return np.empty(0, dtype=storage_dtype(e.dtype))
    a = to_numpy(e.local).reshape(-1)
    if region.part is not None:
        return a[region.part[0]:region.part[1]]  # replicated: every rank holds all, writes its part
    return a
