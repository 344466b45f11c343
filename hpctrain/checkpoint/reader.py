"""Read a checkpoint (parallel or virtual layout) and verify every block read; never unpickles."""

from __future__ import annotations

import os

import h5py
import numpy as np

from hpctrain.checkpoint.checksum import expected_blocks, verify_blocks
from hpctrain.checkpoint.layout import num_rows

__all__ = ["CheckpointError", "Reader"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not fit the model; the message names the dataset."""


class Reader:
    """Reads datasets of one checkpoint file; errors are collected, then raised by check().

    Every rank opens the file read-only with the default driver: reads are independent, so
    ranks at any world size read whatever rows they need.
    """

    def __init__(self, path: str):
        self.path = path
        self.errors: list[str] = []
        try:
            self.f = h5py.File(path, "r", locking=False)
        except OSError as exc:
            raise CheckpointError(f"cannot open checkpoint {path!r}: {exc}; check the path, or "
                                  f"resume from an older checkpoint in the same directory") from None
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

    def has(self, name: str) -> bool:
        return name in self.f

    def dataset(self, name: str) -> h5py.Dataset:
        return h5py.Dataset(h5py.h5d.open(self.f.id, name.encode(), dapl=self._dapl))

    def fail(self, msg: str) -> None:
        self.errors.append(f"checkpoint {self.path}: {msg}")

    def read(self, name: str, shape: tuple | None = None, rows: tuple | None = None):
        """Rows [start, stop) (all when None) of dataset name, checksum-verified; None on error."""
        if name not in self.f:
            self.fail(f"dataset {name!r} is missing; the checkpoint was written for a different "
                      f"model or optimizer (check train.model, model_options and optimizer)")
            return None
        d = self.dataset(name)
        if shape is not None and tuple(d.shape) != tuple(shape):
            self.fail(f"dataset {name!r} has shape {tuple(d.shape)}, the model expects "
                      f"{tuple(shape)}; resume with the config the checkpoint was written with")
            return None
        start = 0 if rows is None else rows[0]
        arr = d[()] if rows is None or d.ndim == 0 else d[rows[0]:rows[1]]
        bad = self._verify(name, d, np.asarray(arr), start)
        if bad:
            self.fail(f"dataset {name!r} fails its checksum (blocks {bad[:8]}); the file is "
                      f"corrupt: resume from an older checkpoint")
            return None
        return np.asarray(arr)

    def verify(self, name: str) -> list[int]:
        """Bad block indices of a whole dataset (for `ckpt inspect`)."""
        d = self.dataset(name)
        return self._verify(name, d, np.asarray(d[()]), 0)

    def _verify(self, name, d, arr, start) -> list[int]:
        if "crc32" not in d.attrs or "crc_block_rows" not in d.attrs:
            return [-1]
        crcs, brows = np.asarray(d.attrs["crc32"]), int(d.attrs["crc_block_rows"])
        if len(crcs) != expected_blocks(tuple(d.shape), brows) and num_rows(tuple(d.shape)):
            return [-1]
        return verify_blocks(arr, start, brows, crcs, num_rows(tuple(d.shape)))

    def check(self, comm=None) -> None:
        """Raise CheckpointError on EVERY rank if any rank found an error (collective with comm)."""
        errors = self.errors
        if comm is not None:
            errors = [e for per_rank in comm.allgather(self.errors) for e in per_rank]
            errors = list(dict.fromkeys(errors))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise CheckpointError(errors[0] + more)

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
