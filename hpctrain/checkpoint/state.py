"""Save and load a training run's whole state (model, optimizer, RNG, data position, losses)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hpctrain.checkpoint import manager
from hpctrain.checkpoint.commit import write_entries
from hpctrain.checkpoint.fit import fit_problems
from hpctrain.checkpoint.layout import Entry, from_numpy
from hpctrain.checkpoint.meta import JSON_ATTRS, torch_dtype
from hpctrain.checkpoint.reader import CheckpointError, Reader, raise_agreed
from hpctrain.checkpoint.writer import SaveSteps
from hpctrain.version import __version__

__all__ = ["RunState", "save_checkpoint", "load_checkpoint", "load_model_state", "read_model_state",
           "write_entries", "attr_problems", "FORMAT", "MODEL_FORMAT"]

FORMAT = "hpctrain-checkpoint-1"
MODEL_FORMAT = FORMAT + "-model"  # `ckpt export`: model tensors only

# Root attributes a file of each format must have; with the integer ones checked for range.
_REQUIRED = {
    FORMAT: ("step", "world_size", "strategy", "config_toml", "sampler_state", "grad_scaler",
             "model_aliases", "optim_class", "optim_param_groups"),
    MODEL_FORMAT: ("step", "model_aliases"),
}
_MIN_INT = {"step": 0, "world_size": 1, "source_world_size": 1}
_RUN_DATASETS = ("rng/torch_cpu", "train/losses")  # written by every save_checkpoint


@dataclass
class RunState:
    """What a checkpoint holds of a run besides its step: the parallelized model and
    optimizer (``par``: writes and reads its own entries), the world it runs on, the data
    position, the losses so far, the fp16 loss scaler and the lr schedule (None: none), and
    the config (stored as TOML for ``ckpt inspect``; not needed to load)."""

    par: Any
    world: Any
    sampler: Any
    losses: list = field(default_factory=list)
    scaler: Any = None
    schedule: Any = None
    cfg: Any = None


def attr_problems(reader: Reader, formats=(FORMAT,)) -> list[str]:
    """What is missing or out of range in reader's root attributes for one of formats.

    Model-independent, so `ckpt inspect` refuses every file that resuming would refuse on
    its attributes (JSON and dtypes were checked when the reader opened the file).
    """
    a = reader.attrs
    fmt = a.get("format")
    if fmt not in formats:
        return [f"attribute 'format' is {fmt!r}, expected {' or '.join(map(repr, formats))}"]
    out = [f"attribute {k!r} is missing" for k in _REQUIRED[fmt] if k not in a]
    for k, least in _MIN_INT.items():
        if k in a and (not isinstance(a[k], (int, np.integer)) or int(a[k]) < least):
            out.append(f"attribute {k!r} is {a[k]!r}, expected an integer >= {least}")
    return out + (_run_problems(reader) if fmt == FORMAT and not out else [])


def _run_problems(reader: Reader) -> list[str]:
    """Facts of a training checkpoint that must agree with each other (a changed one shows
    even in files written before the metadata checksum)."""
    a, out = reader.attrs, []
    sampler_step = json.loads(a["sampler_state"]).get("step")
    if sampler_step != int(a["step"]):
        out.append(f"attribute 'step' is {int(a['step'])} but attribute 'sampler_state' is at "
                   f"step {sampler_step!r}; one of them was changed")
    out += [f"dataset {name!r} is missing" for name in _RUN_DATASETS if not reader.has(name)]
    if reader.has("rng/torch_cpu"):
        rows = reader.dataset("rng/torch_cpu").shape[:1]
        if rows != (int(a["world_size"]),):
            out.append(f"dataset 'rng/torch_cpu' has {rows} rows for attribute 'world_size' = "
                       f"{int(a['world_size'])}")
    return out


def _run_entries(world, sampler, losses):
    # A few KB per rank: gathered and written as one replicated tensor, so its checksum
    # blocks are whole on every writer.
    states = world.mpi_comm.allgather(torch.get_rng_state().numpy())
    rng = Entry("rng/torch_cpu", (world.size, states[0].size), torch.uint8,
                torch.from_numpy(np.stack(states)))
    hist = Entry("train/losses", (len(losses),), torch.float64,
                 torch.tensor(losses, dtype=torch.float64))
    return [rng, hist]


def _agree_dir(directory: str, comm) -> None:
    """Rank 0 creates directory; a failure raises on every rank."""
    err = None
    if comm.Get_rank() == 0:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            err = f"cannot create the checkpoint directory {directory!r}: {exc}"
    raise_agreed(comm, err)


def _after_save(directory: str, final: str, keep: int) -> None:
    """Rank 0: point DIR/latest at final and prune; trouble here is a warning, not a failure
    (the checkpoint is complete; other ranks are not waiting on an error)."""
    try:
        manager.write_latest_pointer(directory, final)
        problems = manager.prune(directory, keep, final)
    except OSError as exc:
        problems = [str(exc)]
    for p in problems:
        print(f"hpctrain: warning: checkpoint housekeeping in {directory}: {p}", file=sys.stderr,
              flush=True)


def save_checkpoint(directory: str, step: int, run: RunState, keep: int = 0) -> str:
    """Write DIR/ckpt-STEP.h5 of ``run`` (collective over the world); keep the newest keep;
    return the path. The lr schedule's and the scaler's state_dicts are stored as JSON."""
    par, world, sampler, scaler, schedule = run.par, run.world, run.sampler, run.scaler, run.schedule
    steps = SaveSteps(world.mpi_comm, 0)  # the watchdog sees these steps too
    with steps, steps("dir"):
        _agree_dir(directory, world.mpi_comm)
    final = manager.checkpoint_path(directory, step)
    meta = {"sampler_state": sampler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else {},
            "lr_schedule": schedule.state_dict() if schedule is not None else {},
            **par.state_meta()}
    attrs = {
        "format": FORMAT, "step": np.int64(step), "config_toml": run.cfg.to_toml(),
        "world_size": np.int64(world.size), "strategy": par.name,
        "hpctrain_version": __version__, "torch_version": str(torch.__version__),
        JSON_ATTRS: json.dumps(sorted(meta)), **{k: json.dumps(v) for k, v in meta.items()},
    }
    entries = par.state_entries() + _run_entries(world, sampler, run.losses)
    write_entries(final, entries, attrs, world.mpi_comm)
    with steps, steps("prune"):
        if world.rank == 0:
            _after_save(directory, final, keep)
        world.mpi_comm.Barrier()
    return final


def _open_everywhere(path: str, comm) -> Reader:
    """Open path on every rank; if any rank cannot, every rank raises (naming that rank)."""
    reader, err = None, None
    try:
        reader = Reader(path)
    except CheckpointError as exc:
        err = f"rank {comm.Get_rank()}: {exc}"
    try:
        raise_agreed(comm, err)
    except CheckpointError:
        if reader is not None:
            reader.close()
        raise
    return reader


def _restore_json(reader: Reader, key: str, load) -> None:
    """load(the JSON of attribute key); a value load rejects names the attribute."""
    try:
        load(json.loads(reader.attrs[key]))
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {reader.path}: attribute {key!r} does not hold a "
                              f"valid state ({type(exc).__name__}: {exc}); resume from an "
                              f"older checkpoint") from None


def load_checkpoint(path: str, run: RunState) -> tuple[int, list[float]]:
    """Restore everything saved by save_checkpoint into ``run`` (its losses are not
    touched); return (step, losses). Collective.

    A checkpoint written before schedules were saved loads as one of the constant schedule."""
    par, world, sampler, scaler, schedule = run.par, run.world, run.sampler, run.scaler, run.schedule
    comm = world.mpi_comm
    with _open_everywhere(path, comm) as reader:
        if not reader.sealed and world.rank == 0:
            print(f"hpctrain: warning: {path} has no metadata checksum (written before "
                  f"hpctrain checked its attributes); its step, optimizer settings and sampler "
                  f"state are loaded unverified", file=sys.stderr, flush=True)
        for msg in attr_problems(reader):
            reader.fail(msg)
        reader.check(comm)  # before any strategy reads an attribute
        # A file of another model is refused here, on every rank together: a strategy's
        # loader reads only its part and meets a wrong shape alone.
        for msg in fit_problems(reader, par.state_entries()):
            reader.fail(msg)
        reader.check(comm)
        par.load_state_entries(reader)
        saved_world = int(reader.attrs["world_size"])
        r = world.rank % saved_world  # more ranks than written: reuse the states round-robin
        rng = reader.read("rng/torch_cpu", rows=(r, r + 1))
        hist = reader.read("train/losses")
        reader.check(comm)
        torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(rng[0])))
        # The same attributes on every rank: a rejected one raises on all of them.
        _restore_json(reader, "sampler_state", sampler.load_state_dict)
        if scaler is not None:
            _restore_json(reader, "grad_scaler", lambda s: s and scaler.load_state_dict(s))
        if schedule is not None:
            if "lr_schedule" in reader.attrs:
                _restore_json(reader, "lr_schedule", schedule.load_state_dict)
            else:
                schedule.load_state_dict({"name": "constant", "steps_done": int(reader.attrs["step"])})
        return int(reader.attrs["step"]), [float(x) for x in hist]


def read_model_state(path: str) -> dict[str, torch.Tensor]:
    """The model state_dict stored in a checkpoint or an export, every key (on this process).

    Tied keys (``model_aliases``) map to the same tensor as the key they share it with, as in
    the model's own state_dict, so ``model.load_state_dict(read_model_state(p), strict=True)``
    works for models with tied weights.
    """
    with Reader(path) as reader:
        raise_agreed(None, [f"checkpoint {path}: {m}"
                            for m in attr_problems(reader, (FORMAT, MODEL_FORMAT))])
        state = {}
        for name in reader.names():
            if name.startswith("model/"):
                a = reader.read(name)
                if a is not None:
                    dtype = torch_dtype(reader.dataset(name).attrs["torch_dtype"])
                    state[name[len("model/"):]] = from_numpy(np.asarray(a), dtype)
        reader.check()
        for key, first in json.loads(reader.attrs["model_aliases"]).items():
            if key not in state and first in state:
                state[key] = state[first]
    return state


def load_model_state(model: torch.nn.Module, path: str) -> None:
    """Load the model tensors of a checkpoint (or an export) into model, on this process only."""
    state = read_model_state(path)
    errors = []
    for key, t in model.state_dict(keep_vars=True).items():
        got = state.get(key)
        if got is None:
            errors.append(f"checkpoint {path}: dataset {'model/' + key!r} is missing; it was "
                          f"written for a different model")
        elif tuple(got.shape) != tuple(t.shape):
            errors.append(f"checkpoint {path}: dataset {'model/' + key!r} has shape "
                          f"{tuple(got.shape)}, the model expects {tuple(t.shape)}")
    raise_agreed(None, errors)
    with torch.no_grad():
        for key, t in model.state_dict(keep_vars=True).items():
            t.copy_(state[key].reshape(t.shape))
