"""Checkpoints forged from a real one: a dataset that points at another file, or that claims
more data than the file holds. Each is resealed (its metadata checksum matches), so only the
checks of hpctrain/checkpoint/trust.py stand between it and a reader.

Where a forgery points elsewhere, the other file holds the very dataset it replaces (same
data, same checksum attributes): without those checks it would load without any error.
"""

from __future__ import annotations

import os
import shutil

import h5py
import numpy as np

from hpctrain.checkpoint.meta import seal

TARGET = "model/ln_f.bias"  # (48,) float32 in the GPT test checkpoint


def _elsewhere(f, d: str) -> str:
    """Copy TARGET (data and attributes) to d/other.h5 as 'stolen'; remove it from f."""
    other = os.path.join(d, "other.h5")
    with h5py.File(other, "w") as o:
        f.copy(f[TARGET], o, "stolen")
    del f[TARGET]
    return other


def _attrs_of(f) -> dict:
    return dict(f[TARGET].attrs)


def _claims(n: int, **kwargs):
    """TARGET replaced by a dataset of n float32 elements the file does not hold."""
    def change(f, d):
        del f[TARGET]
        ds = f.create_dataset(TARGET, shape=(n,), dtype="f4", **kwargs)
        ds.attrs.update({"crc32": np.zeros(1, np.uint32), "crc_block_elems": np.int64(n),
                         "torch_dtype": "float32"})
        if "compression" in kwargs:  # one chunk written (zeros: deflate's best), none other
            ds[:kwargs["chunks"][0]] = 0
    return change


def _external_link(f, d):
    f[TARGET] = h5py.ExternalLink(_elsewhere(f, d), "/stolen")


def _soft_link(f, d):
    del f[TARGET]
    f[TARGET] = h5py.SoftLink("/model/ln_f.weight")


def _external_storage(f, d):
    attrs, data = _attrs_of(f), f[TARGET][()]
    raw = os.path.join(d, "raw.bin")
    data.tofile(raw)
    del f[TARGET]
    ds = f.create_dataset(TARGET, shape=data.shape, dtype=data.dtype,
                          external=[(raw, 0, data.nbytes)])
    ds.attrs.update(attrs)


def _virtual(f, d):
    attrs, shape = _attrs_of(f), f[TARGET].shape
    other = _elsewhere(f, d)
    layout = h5py.VirtualLayout(shape=shape, dtype="f4")
    layout[:] = h5py.VirtualSource(other, "stolen", shape=shape)
    f.create_virtual_dataset(TARGET, layout).attrs.update(attrs)


# name -> (change(f, directory), words the one-line error must hold)
FORGERIES = {
    "absurd_shape": (_claims(10 ** 12), f"dataset {TARGET!r} claims shape (1000000000000,) of "
                     f"float32 (4,000,000,000,000 bytes) but the file stores none for it"),
    "unwritten_chunks": (_claims(10 ** 10, chunks=(1 << 20,)),
                         "(40,000,000,000 bytes) but the file stores 0 bytes in chunks"),
    "gzip_beyond_deflate": (_claims(10 ** 9, chunks=(1 << 22,), compression="gzip"),
                            "(at most 1032x that decoded)"),
    "external_link": (_external_link, f"{TARGET!r} is an external link to '/stolen' in the "
                      f"file"),
    "soft_link": (_soft_link, f"{TARGET!r} is a soft link to '/model/ln_f.weight'"),
    "external_storage": (_external_storage, f"dataset {TARGET!r} keeps its data in the "
                         f"external raw file"),
    "virtual_elsewhere": (_virtual, f"dataset {TARGET!r} is a virtual dataset reading "
                          f"'stolen' in the file"),
}


def forge(src: str, d: str, name: str) -> str:
    """d/<src's file name>: src with FORGERIES[name] applied, resealed; its path."""
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, os.path.basename(src))
    shutil.copy(src, path)
    with h5py.File(path, "r+") as f:
        FORGERIES[name][0](f, d)
        seal(f)
    return path


if __name__ == "__main__":  # forge.py SRC DIR NAME: a pool step forges a file a later step reads
    import sys

    forge(*sys.argv[1:4])
