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
           "torch_dtype", "param_group_problems"]

META_CRC = "meta_crc32"
JSON_ATTRS = "json_attrs"  # names of the root attributes that hold JSON (a JSON list)

# JSON attributes of files written before JSON_ATTRS existed, and the type each must hold.
_KNOWN_JSON = {"sampler_state": dict, "grad_scaler": dict, "model_aliases": dict,
               "optim_class": str, "optim_param_groups": list}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What a value must be, by the words that name it in an error.
NUMBER, COUNT, INTEGER = "a number", "an integer >= 0", "an integer"
_KINDS = {
    NUMBER: _number,
    COUNT: lambda v: _integer(v) and v >= 0,
    INTEGER: _integer,
    "true or false": lambda v: isinstance(v, bool),
    "true, false or null": lambda v: v is None or isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, dict),
    "a list of numbers": lambda v: isinstance(v, list) and all(map(_number, v)),
    "a pair of numbers": lambda v: isinstance(v, list) and len(v) == 2 and all(map(_number, v)),
    "a number or a list of numbers and nulls": lambda v: _number(v) or (
        isinstance(v, list) and all(x is None or _number(x) for x in v)),
    "a list of names": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}

# The fields of the JSON objects a checkpoint holds that hpctrain (or torch) reads back, and
# what each must be: a hand-edited value of another type is refused on open (inspect and
# resume alike), not met as a TypeError in the middle of a training step. Fields not named
# here (another optimizer's, a custom scheduler's) are checked on resume against the live
# object (param_group_problems).
_FIELDS = {
    "sampler_state": {"step": COUNT},
    "grad_scaler": {"scale": NUMBER, "growth_factor": NUMBER, "backoff_factor": NUMBER,
                    "growth_interval": COUNT, "_growth_tracker": COUNT},
    "lr_schedule": {"name": "a string", "steps_done": COUNT, "state": "an object"},
    "lr_schedule.state": {"last_epoch": INTEGER, "_step_count": COUNT,
                          "base_lrs": "a list of numbers", "_last_lr": "a list of numbers"},
    "optim_param_groups": {  # torch.optim's hyper-parameters
        "params": "a list of names", **dict.fromkeys(
            ("lr", "initial_lr", "weight_decay", "momentum", "dampening", "alpha",
             "lr_decay", "initial_accumulator_value", "rho", "momentum_decay", "lambd", "t0"),
            NUMBER),
        **dict.fromkeys(("betas", "etas", "step_sizes"), "a pair of numbers"),
        "eps": "a number or a list of numbers and nulls",  # Adafactor: (None, 1e-3)
        **dict.fromkeys(("amsgrad", "maximize", "capturable", "differentiable", "nesterov",
                         "centered", "decoupled_weight_decay"), "true or false"),
        **dict.fromkeys(("foreach", "fused"), "true, false or null")},
}


def _json_type(v) -> str:
    """The JSON type of a parsed value, as an error names it."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), "null")


def _field_problems(where: str, obj: dict, fields: dict) -> list[str]:
    return [f"{where} has {k!r} = {obj[k]!r} ({_json_type(obj[k])}), expected {kind}"
            for k, kind in fields.items() if k in obj and not _KINDS[kind](obj[k])]


def _value_problems(key: str, value) -> list[str]:
    """What is of the wrong type inside the JSON attribute key (value: its parsed form)."""
    where = f"attribute {key!r}"
    if key == "optim_param_groups":
        return [p for i, g in enumerate(value)
                for p in _field_problems(f"{where} group {i}", g, _FIELDS[key])]
    if key == "model_aliases":
        bad = [(k, v) for k, v in value.items() if not isinstance(v, str)]
        return [f"{where} has {k!r} = {v!r}, expected the name of the key it shares a tensor "
                f"with" for k, v in bad[:1]]
    out = _field_problems(where, value, _FIELDS.get(key, {}))
    if key == "lr_schedule" and isinstance(value.get("state"), dict):
        out += _field_problems(f"{where} 'state'", value["state"], _FIELDS[key + ".state"])
    return out


def param_group_problems(saved: list, live: list, optimizer: str) -> list[str]:
    """Hyper-parameters of the checkpoint's param groups (saved) whose type differs from
    the one the live optimizer's groups hold (a number for a number, true/false for a
    bool, a list of the same length for a tuple); the same words as on open."""
    out = []
    for i, (g, sg) in enumerate(zip(live, saved)):
        for k, v in sg.items():
            if k != "params" and k in g and not _like(g[k], v):
                out.append(f"attribute 'optim_param_groups' group {i} has {k!r} = {v!r} "
                           f"({_json_type(v)}), expected {_kind_of(g[k])} as {optimizer} "
                           f"holds")
    return out


def _like(live, v) -> bool:
    if isinstance(live, bool):
        return isinstance(v, bool)
    if _number(live) or isinstance(live, torch.Tensor):  # a tensor lr (capturable)
        return _number(v)
    if isinstance(live, (tuple, list)):
        return isinstance(v, list) and len(v) == len(live) and all(map(_like, live, v))
    if isinstance(live, str):
        return isinstance(v, str)
    if live is None:  # torch's "decide for me" (foreach, fused): any single value
        return not isinstance(v, (list, dict))
    return True  # a type JSON cannot hold: nothing to compare with


def _kind_of(live) -> str:
    if isinstance(live, bool):
        return "true or false"
    if isinstance(live, (tuple, list)):
        return f"a list of {len(live)}"
    if isinstance(live, str):
        return "a string"
    return "a number" if live is not None else "a single value"


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
        want = _KNOWN_JSON.get(k, dict if k in _FIELDS else None)
        if want is not None and not isinstance(value, want):
            out.append(f"attribute {k!r} holds a {type(value).__name__}, expected a "
                       f"{want.__name__}")
        elif k == "optim_param_groups" and not all(isinstance(g, dict) for g in value):
            out.append(f"attribute {k!r} must be a list of objects (one per param group)")
        elif want is not None:
            out += _value_problems(k, value)
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


def _rng_problems(names: list[str], f: h5py.File) -> list[str]:
    """torch's CPU generator states, one row per rank, as torch.set_rng_state takes them."""
    if "rng/torch_cpu" not in names:
        return []
    d, want = f["rng/torch_cpu"], torch.get_rng_state().numel()
    if d.dtype == np.uint8 and d.ndim == 2 and d.shape[1] == want:
        return []
    return [f"dataset 'rng/torch_cpu' is {d.dtype} of shape {tuple(d.shape)}, expected uint8 "
            f"of shape (world size, {want}): torch's CPU generator state per rank"]


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
    return sealed, (out + _json_problems(f.attrs) + _dtype_problems(f)
                    + _rng_problems(dataset_names(f), f))
