"""`hpctrain ckpt inspect|export`: look into a checkpoint, or consolidate its model state.

Both refuse what resuming would refuse (metadata checksum, attributes, tensor checksums) and
report it in one line; the CLI turns CheckpointError into ``hpctrain: error: ...``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

from hpctrain.checkpoint.layout import Entry
from hpctrain.checkpoint.meta import JSON_ATTRS
from hpctrain.checkpoint.reader import CheckpointError, Reader
from hpctrain.checkpoint.state import (FORMAT, MODEL_FORMAT, attr_problems, read_model_state,
                                       write_entries)
from hpctrain.version import __version__

__all__ = ["inspect", "export"]

_SOURCE = ("source_path", "source_strategy", "source_world_size")


def _header(path: str, a) -> str:
    if a.get("format") == MODEL_FORMAT:
        return (f"{path}: model export of {a.get('source_path')} (step {a.get('step')}, written "
                f"by strategy {a.get('source_strategy')} at world size "
                f"{a.get('source_world_size')}), hpctrain {a.get('hpctrain_version')}, torch "
                f"{a.get('torch_version')}")
    return (f"{path}: step {a.get('step')}, written by strategy {a.get('strategy')!s} at world "
            f"size {a.get('world_size')}, layout {a.get('layout', 'parallel')}, hpctrain "
            f"{a.get('hpctrain_version')}, torch {a.get('torch_version')}")


def _verify_all(reader: Reader, out) -> list[str]:
    """Print one line per dataset with its checksum status; return the failures."""
    bad, total = [], 0
    for i, name in enumerate(reader.names()):
        d = reader.dataset(name)
        nbytes = d.size * d.dtype.itemsize
        total += nbytes
        why = reader.verify(name, i)
        if why is not None:
            bad.append((name, why))
        dtype = d.attrs.get("torch_dtype", str(d.dtype))
        status = "ok" if why is None else "BAD CHECKSUM"
        print(f"  {name:<48} {str(tuple(d.shape)):<16} {dtype:<9} {nbytes:>12,d} B  {status}",
              file=out)
    metadata = "ok" if reader.sealed else "no checksum (older file: attributes unverified)"
    print(f"total {total:,d} bytes; checksums: "
          f"{'all ok' if not bad else 'BAD in ' + ', '.join(n for n, _ in bad)}; metadata: "
          f"{metadata}", file=out)
    return [why for _, why in bad]


def inspect(path: str, out=sys.stdout) -> int:
    """Print datasets, shapes, dtypes, sizes, step, strategy and world; verify everything that
    resuming verifies. Returns 1 (after one ``hpctrain: error`` line) when any of it fails."""
    try:
        reader = Reader(path)
    except CheckpointError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 1
    with reader:
        print(_header(path, reader.attrs), file=out)
        problems = [f"checkpoint {path}: {m}"
                    for m in attr_problems(reader, (FORMAT, MODEL_FORMAT))]
        problems += _verify_all(reader, out)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"hpctrain: error: {problems[0]}{more}", file=sys.stderr)
        return 1
    return 0


def _provenance(path: str, a) -> dict:
    """Where an export comes from: the checkpoint's step, strategy, world size and path (an
    export of an export keeps the original's)."""
    if a.get("format") == MODEL_FORMAT:
        return {k: a[k] for k in _SOURCE + ("step",) if k in a}
    return {"source_path": os.path.abspath(path), "source_strategy": str(a["strategy"]),
            "source_world_size": np.int64(a["world_size"]), "step": np.int64(a["step"])}


def _check_out(path: str, out_path: str) -> None:
    if os.path.isdir(out_path):
        raise CheckpointError(f"ckpt export: {out_path!r} is a directory; give the file to "
                              f"write, such as {os.path.join(out_path, 'model.h5')!r}")
    parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(parent):
        raise CheckpointError(f"ckpt export: the directory {parent!r} of {out_path!r} does not "
                              f"exist; create it first")
    if os.path.exists(out_path) and os.path.samefile(path, out_path):
        raise CheckpointError(f"ckpt export: {out_path!r} is the checkpoint itself; give "
                              f"another file name")


def export(path: str, out_path: str) -> int:
    """Write every model state_dict key of path (verified) to out_path, a model-only file.

    Tied keys are written under each of their names (``model_aliases`` stays as metadata),
    so a plain ``load_state_dict(strict=True)`` finds every key.
    """
    from mpi4py import MPI

    _check_out(path, out_path)
    with Reader(path) as reader:
        problems = attr_problems(reader, (FORMAT, MODEL_FORMAT))
        if problems:
            raise CheckpointError(f"checkpoint {path}: {problems[0]}")
        attrs = {k: reader.attrs[k] for k in ("config_toml", "model_aliases")
                 if k in reader.attrs}
        attrs.update(_provenance(path, reader.attrs))
    state = read_model_state(path)
    entries = [Entry(f"model/{k}", tuple(t.shape), t.dtype, t) for k, t in state.items()]
    attrs.update({"format": MODEL_FORMAT, "hpctrain_version": __version__,
                  "torch_version": str(torch.__version__),
                  JSON_ATTRS: json.dumps(["model_aliases"])})
    write_entries(out_path, entries, attrs, MPI.COMM_SELF)
    print(f"exported {len(entries)} model tensors (step {attrs['step']}) to {out_path}; load "
          f"with hpctrain.checkpoint.read_model_state(path) (a plain state_dict) or "
          f"load_model_state(model, path)")
    return 0
