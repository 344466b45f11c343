"""Checksum and validate a checkpoint's metadata: the HDF5 attributes of the file and its datasets.

The tensors carry block CRCs, but the step, the optimizer's param groups (lr), the sampler
position and the config are attributes: one flipped bit there resumes at a wrong step or
learning rate with no error. ``seal`` stores a CRC32 of the canonical JSON of every attribute;
``problems`` recomputes it and checks each attribute's form (JSON that parses, values of the
expected type, a known ``torch_dtype``), so a reader refuses the file before loading anything
and strategies never meet a raw JSONDecodeError or KeyError.
"""

from __future__ import annotations

import json
import zlib

import h5py
import numpy as np
import torch

from hpctrain.checkpoint.layout import storage_dtype

__all__ = ["META_CRC", "JSON_ATTRS", "seal", "meta_crc", "problems", "dataset_names",
           "torch_dtype"]

META_CRC = "meta_crc32"
JSON_ATTRS = "json_attrs"  # names of the root attributes that hold JSON (a JSON list)

# JSON attributes of files written before JSON_ATTRS existed, and the type each must hold.
_KNOWN_JSON = {"sampler_state": dict, "grad_scaler": dict, "model_aliases": dict,
               "optim_class": str, "optim_param_groups": list}


def dataset_names(f: h5py.File) -> list[str]:
    """Paths of every dataset in f, sorted."""
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return sorted(names)


def _plain(v):
    """An attribute value as plain JSON data (numpy scalars/arrays and bytes converted)."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()] if v.dtype.kind in "SO" else v.tolist()
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    return v


def _canonical(f: h5py.File) -> bytes:
    doc = {"/": {k: _plain(v) for k, v in f.attrs.items() if k != META_CRC}}
    for name in dataset_names(f):
        doc[name] = {k: _plain(v) for k, v in f[name].attrs.items()}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode("utf-8",
                                                                          "surrogateescape")


def meta_crc(f: h5py.File) -> int:
    """CRC32 of the canonical JSON of all attributes of f and its datasets (but META_CRC)."""
    return zlib.crc32(_canonical(f))


def seal(f: h5py.File) -> None:
    """Store meta_crc(f) as the last attribute (collective in parallel HDF5: same on all ranks)."""
    f.attrs[META_CRC] = np.int64(meta_crc(f))


def torch_dtype(name) -> torch.dtype | None:
    """The torch dtype called name ('float32'), or None when there is none."""
    dt = getattr(torch, str(name), None)
    return dt if isinstance(dt, torch.dtype) else None


def _json_names(attrs) -> tuple[list[str], list[str]]:
    """(names of the JSON attributes, problems reading that list)."""
    if JSON_ATTRS not in attrs:
        return [k for k in _KNOWN_JSON if k in attrs], []
    try:
        names = json.loads(attrs[JSON_ATTRS])
    except (TypeError, ValueError) as exc:
        return [], [f"attribute {JSON_ATTRS!r} is not valid JSON ({exc})"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return [], [f"attribute {JSON_ATTRS!r} is {names!r}, expected a list of names"]
    return names, []


def _json_problems(attrs) -> list[str]:
    names, out = _json_names(attrs)
    for k in names:
        if k not in attrs:
            out.append(f"attribute {k!r} is missing (listed in {JSON_ATTRS!r})")
            continue
        try:
            value = json.loads(attrs[k])
        except (TypeError, ValueError) as exc:
            out.append(f"attribute {k!r} is not valid JSON ({exc})")
            continue
        want = _KNOWN_JSON.get(k)
        if want is not None and not isinstance(value, want):
            out.append(f"attribute {k!r} holds a {type(value).__name__}, expected a "
                       f"{want.__name__}")
        elif k == "optim_param_groups" and not all(isinstance(g, dict) for g in value):
            out.append(f"attribute {k!r} must be a list of objects (one per param group)")
    return out


def _dtype_problems(f: h5py.File) -> list[str]:
    out = []
    for name in dataset_names(f):
        d = f[name]
        if "torch_dtype" not in d.attrs:
            out.append(f"dataset {name!r} has no attribute 'torch_dtype'")
            continue
        raw = _plain(d.attrs["torch_dtype"])
        dt = torch_dtype(raw)
        if dt is None:
            out.append(f"dataset {name!r}: attribute 'torch_dtype' is {raw!r}, not a torch "
                       f"dtype name (such as 'float32')")
        elif storage_dtype(dt) != d.dtype:
            out.append(f"dataset {name!r}: attribute 'torch_dtype' is {raw!r} but the data is "
                       f"stored as {d.dtype}")
    return out


def problems(f: h5py.File) -> tuple[bool, list[str]]:
    """(whether f is sealed, what is wrong with its metadata); an empty list: all is well."""
    try:
        crc = meta_crc(f)
    except (OSError, ValueError, UnicodeError) as exc:
        return META_CRC in f.attrs, [f"its attributes cannot be read ({exc})"]
    sealed = META_CRC in f.attrs
    out = []
    if sealed:
        try:
            stored = int(f.attrs[META_CRC])
        except (TypeError, ValueError):
            stored = None
        if stored != crc:
            out.append(f"metadata checksum mismatch (attribute {META_CRC!r} is {stored}, the "
                       f"attributes give {crc}): an attribute (step, optimizer settings, "
                       f"sampler state, config, dtypes) differs from what was saved")
    return sealed, out + _json_problems(f.attrs) + _dtype_problems(f)
