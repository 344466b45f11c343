"""`hpctrain ckpt inspect|export`: look into a checkpoint, or consolidate its model state."""

from __future__ import annotations

import sys

import h5py
import numpy as np

from hpctrain.checkpoint.layout import Entry, from_numpy
from hpctrain.checkpoint.reader import CheckpointError, Reader

__all__ = ["inspect", "export"]


def _datasets(f: h5py.File) -> list[str]:
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return sorted(names)


def inspect(path: str, out=sys.stdout) -> int:
    """Print datasets, shapes, dtypes, sizes, step, strategy and world; verify checksums (1: bad)."""
    try:
        reader = Reader(path)
    except CheckpointError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 1
    bad = []
    with reader:
        a = reader.attrs
        print(f"{path}: step {a.get('step')}, written by strategy {a.get('strategy')!s} at "
              f"world size {a.get('world_size')}, layout {a.get('layout', 'parallel')}, "
              f"hpctrain {a.get('hpctrain_version')}, torch {a.get('torch_version')}", file=out)
        total = 0
        for name in _datasets(reader.f):
            d = reader.dataset(name)
            nbytes = d.size * d.dtype.itemsize
            total += nbytes
            status = "ok" if not reader.verify(name) else "BAD CHECKSUM"
            if status != "ok":
                bad.append(name)
            dtype = d.attrs.get("torch_dtype", str(d.dtype))
            print(f"  {name:<48} {str(tuple(d.shape)):<16} {dtype:<9} {nbytes:>12,d} B  {status}",
                  file=out)
        print(f"total {total:,d} bytes; checksums: "
              f"{'all ok' if not bad else 'BAD in ' + ', '.join(bad)}", file=out)
    if bad:
        print(f"hpctrain: error: {path}: dataset {bad[0]!r} fails its checksum", file=sys.stderr)
        return 1
    return 0


def export(path: str, out_path: str) -> int:
    """Write the model tensors of path (verified) to out_path as a one-rank checkpoint."""
    import json

    from mpi4py import MPI

    from hpctrain.checkpoint.state import FORMAT, write_entries

    with Reader(path) as reader:
        entries = []
        for name in _datasets(reader.f):
            if name.startswith("model/"):
                a = reader.read(name)
                dtype = reader.dataset(name).attrs["torch_dtype"]
                if a is not None:
                    import torch

                    t = from_numpy(np.asarray(a), getattr(torch, dtype))
                    entries.append(Entry(name, tuple(t.shape), t.dtype, t))
        reader.check()
        attrs = {k: reader.attrs[k] for k in ("config_toml", "hpctrain_version", "torch_version",
                                              "model_aliases", "step") if k in reader.attrs}
    attrs.update(format=FORMAT + "-model", strategy="single", world_size=np.int64(1),
                 exported_from=json.dumps(path))
    write_entries(out_path, entries, attrs, MPI.COMM_SELF)
    print(f"exported {len(entries)} model tensors to {out_path} "
          f"(load with hpctrain.checkpoint.load_model_state(model, path))")
    return 0
