"""Read a checkpoint (parallel or virtual layout) and verify every block read; never unpickles."""

from __future__ import annotations

import os

import h5py
import numpy as np

from hpctrain.checkpoint import meta, trust
from hpctrain.checkpoint.checksum import expected_blocks, verify_flat
from hpctrain.checkpoint.hyperslab import read_flat
from hpctrain.checkpoint.layout import box_parts, numel

__all__ = ["CheckpointError", "Reader", "raise_agreed"]

# verify() reads at most this much at a time (whole checksum blocks; at least one).
_VERIFY_BYTES = 64 << 20


def _integer(v) -> int:
    """v as an int; TypeError unless it is one (a string or float attribute is damage)."""
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{v!r} is not an integer")
    return int(v)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the model; the message names the dataset."""


def raise_agreed(comm, errors: list[str] | str | None) -> None:
    """Raise CheckpointError on EVERY rank if any rank has errors (collective over comm).

    errors: this rank's messages (one, or None for none); comm None: this process only. The
    first error is named, with how many more there are.
    """
    errors = [errors] if isinstance(errors, str) else list(errors or ())
    if comm is not None:
        errors = [e for per_rank in comm.allgather(list(errors)) for e in per_rank]
    errors = list(dict.fromkeys(errors))
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise CheckpointError(errors[0] + more)


class Reader:
    """Reads datasets of one checkpoint file; errors are collected, then raised by check().

    Every rank opens the file read-only with the default driver: reads are independent, so
    ranks at any world size read whatever rows or flat element ranges they need. Opening
    checks that the file holds only its own data, of sizes it can hold (trust.py), and
    verifies the metadata (meta.py); it raises CheckpointError when either is wrong.
    ``sealed`` is False for files written before the metadata had a checksum.
    """

    def __init__(self, path: str):
        self.path = path
        self.errors: list[str] = []
        try:
            self.f = h5py.File(path, "r", locking=False)
        except OSError as exc:
            raise CheckpointError(f"cannot open checkpoint {path!r}: {exc}; check the path, or "
                                  f"resume from an older checkpoint in the same directory") from None
        untrusted = trust.problems(self.f, path)
        if untrusted:
            self.f.close()
            raise_agreed(None, [f"checkpoint {path}: {p}" for p in untrusted])
        self.sealed, problems = meta.problems(self.f)
        if problems:
            self.f.close()
            raise_agreed(None, [f"checkpoint {path}: {p}; the file was changed or damaged after "
                                f"it was written: resume from an older checkpoint"
                                for p in problems])
        # Virtual datasets name their per-rank files relative to the master's directory.
        self._dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
        self._dapl.set_virtual_prefix(os.path.dirname(os.path.abspath(path)).encode() + b"/")

    @property
    def attrs(self):
        return self.f.attrs

    def keys(self, group: str) -> list[str]:
        """Names of the members of group (empty when it is absent)."""
        g = self.f.get(group)
        return sorted(g.keys()) if isinstance(g, h5py.Group) else []

    def names(self) -> list[str]:
        """Paths of every dataset in the file, sorted."""
        return meta.dataset_names(self.f)

    def has(self, name: str) -> bool:
        return name in self.f

    def dataset(self, name: str) -> h5py.Dataset:
        return h5py.Dataset(h5py.h5d.open(self.f.id, name.encode(), dapl=self._dapl))

    def fail(self, msg: str) -> None:
        self.errors.append(f"checkpoint {self.path}: {msg}")

    def read(self, name: str, shape: tuple | None = None, rows: tuple | None = None,
             elems: tuple | None = None, box: tuple | None = None):
        """Checksum-verified part of dataset name; None on error (collected for check()).

        rows=(start, stop): those rows; box=(offset, count): that N-D hyperslab (a
        tensor-parallel slice; (offset, count, view): a box of the tensor seen as the shape
        view, e.g. whole heads of a fused qkv weight); elems=(start, stop): those elements of the row-major flattened
        tensor (or, with box, of the flattened box), as a 1-D array; none: the whole tensor.
        The whole canonical blocks around the part are read to verify them.
        """
        from hpctrain.checkpoint.hyperslab import box_runs

        if name not in self.f:
            self.fail(f"dataset {name!r} is missing; the checkpoint was written for a different "
                      f"model or optimizer (check train.model, model_options and optimizer)")
            return None
        d = self.dataset(name)
        if shape is not None and tuple(d.shape) != tuple(shape):
            self.fail(f"dataset {name!r} has shape {tuple(d.shape)}, the model expects "
                      f"{tuple(shape)}; resume with the config the checkpoint was written with")
            return None
        dshape, total = tuple(d.shape), numel(tuple(d.shape))
        if rows is not None and d.ndim:
            box = ((int(rows[0]),) + (0,) * (d.ndim - 1),
                   (int(rows[1]) - int(rows[0]),) + dshape[1:])
        runs, out_shape = None, dshape
        if box is not None and d.ndim:
            off, cnt, view = box_parts(box, dshape)
            if numel(view) != total or len(off) != len(view) or len(cnt) != len(view) or any(
                    o < 0 or c < 0 or o + c > n for o, c, n in zip(off, cnt, view)):
                self.fail(f"dataset {name!r} of shape {dshape} has no box offset {off} count "
                          f"{cnt}{'' if view == dshape else f' of the view {view}'}; the "
                          f"checkpoint was written for a different model or sharding")
                return None
            lo, hi = (0, numel(cnt)) if elems is None else (int(elems[0]), int(elems[1]))
            if not 0 <= lo <= hi <= numel(cnt):
                self.fail(f"dataset {name!r}: box count {cnt} has no elements {(lo, hi)}; the "
                          f"checkpoint was written for a different model or sharding")
                return None
            runs = box_runs(view, off, cnt, lo, hi)
            out_shape = cnt if elems is None else (hi - lo,)
        elif elems is not None:
            start, stop = (int(x) for x in elems)
            if not 0 <= start <= stop <= total:
                self.fail(f"dataset {name!r} of shape {dshape} has no elements {tuple(elems)}; "
                          f"the checkpoint was written for a different model or sharding")
                return None
            runs = np.array([[start, stop]] if stop > start else [], np.int64).reshape(-1, 2)
            out_shape = (stop - start,)
        if runs is not None and not len(runs):
            return np.empty(out_shape, dtype=d.dtype)
        start, stop = (0, total) if runs is None else (int(runs[0, 0]), int(runs[-1, 1]))
        belems, crcs = self._blocks(d)
        if crcs is None:
            self.fail(f"dataset {name!r} has no valid checksum attributes (crc32, "
                      f"crc_block_elems); the file is damaged or not an hpctrain checkpoint")
            return None
        # Widen to whole canonical blocks so every block that is read is verified.
        lo = start // belems * belems if stop > start else start
        hi = min(-(-stop // belems) * belems, total) if stop > start else stop
        try:
            flat = read_flat(d, lo, hi)
        except OSError as exc:
            self.fail(f"dataset {name!r} cannot be read ({exc}); the file is damaged: resume "
                      f"from an older checkpoint")
            return None
        bad = verify_flat(flat, lo, belems, crcs, total)
        if bad:
            self.fail(f"dataset {name!r} fails its checksum (blocks {bad[:8]}); the file is "
                      f"corrupt: resume from an older checkpoint")
            return None
        if d.ndim == 0 and elems is None:
            return flat.reshape(())
        flat = flat.reshape(-1)
        if runs is None:
            return flat.reshape(out_shape)
        if len(runs) == 1:
            return flat[start - lo:stop - lo].reshape(out_shape)
        return np.concatenate([flat[a - lo:b - lo] for a, b in runs.tolist()]).reshape(out_shape)

    def verify(self, name: str, index: int = 0, share: tuple = (0, 1)) -> str | None:
        """Why dataset name fails verification, or None when its checksums hold.

        share=(rank, ranks): only this rank's whole blocks of the index-th dataset (a
        rotated contiguous split), so ranks verify a file together in parallel.
        """
        d = self.dataset(name)
        belems, crcs = self._blocks(d)
        if crcs is None:
            return (f"checkpoint {self.path}: dataset {name!r} has no valid checksum attributes "
                    f"(crc32, crc_block_elems); the file is damaged or not an hpctrain checkpoint")
        total = numel(tuple(d.shape))
        nblocks, (rank, ranks) = expected_blocks(total, belems), share
        pos = (rank - index) % ranks  # rotated, so one-block tensors spread over ranks
        lo = min(pos * nblocks // ranks * belems, total)
        hi = min((pos + 1) * nblocks // ranks * belems, total)
        # Whole blocks at a time, so a large tensor is not read into memory at once.
        step = max(1, _VERIFY_BYTES // (belems * d.dtype.itemsize)) * belems
        bad = []
        try:
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                bad += verify_flat(read_flat(d, start, stop), start, belems, crcs, total)
        except OSError as exc:
            return f"checkpoint {self.path}: dataset {name!r} cannot be read ({exc})"
        if bad:
            return (f"checkpoint {self.path}: dataset {name!r} fails its checksum (blocks "
                    f"{bad[:8]}); the file is corrupt")
        return None

    def _blocks(self, d) -> tuple[int, np.ndarray | None]:
        """(elements per block, block CRCs) of d, or (1, None) when absent or inconsistent."""
        a = d.attrs
        if "crc32" not in a:
            return 1, None
        try:
            if "crc_block_elems" in a:
                belems = _integer(a["crc_block_elems"])
            elif "crc_block_rows" in a:  # older files: blocks of whole rows are flat blocks too
                belems = _integer(a["crc_block_rows"]) * (numel(tuple(d.shape)[1:]) if d.ndim
                                                          else 1)
            else:
                return 1, None
        except TypeError:
            return 1, None
        crcs = np.asarray(a["crc32"]).reshape(-1)
        if (belems <= 0 or crcs.dtype.kind not in "ui"
                or len(crcs) != expected_blocks(numel(tuple(d.shape)), belems)):
            return 1, None
        return belems, crcs

    def check(self, comm=None) -> None:
        """Raise CheckpointError on EVERY rank if any rank found an error (collective with comm)."""
        raise_agreed(comm, self.errors)

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
