"""Save and load a training run's whole state (model, optimizer, RNG, data position, losses)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from hpctrain.checkpoint import manager
from hpctrain.checkpoint.layout import Entry, from_numpy
from hpctrain.checkpoint.reader import CheckpointError, Reader
from hpctrain.checkpoint.serial_fallback import use_serial, write_serial
from hpctrain.checkpoint.writer import write_parallel

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_state", "write_entries"]

FORMAT = "hpctrain-checkpoint-1"


def write_entries(final: str, entries: list[Entry], attrs: dict, comm) -> None:
    """Write entries to final via its temporary name, then rename (collective over comm)."""
    rank = comm.Get_rank()
    tmp = manager.tmp_path(final)
    if use_serial(rank):
        write_serial(tmp, final, entries, attrs, comm)
    else:
        write_parallel(tmp, entries, attrs, comm)
    comm.Barrier()  # every rank closed (and so flushed) the file
    if rank == 0:
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    comm.Barrier()


def _run_entries(world, sampler, losses):
    # A few KB per rank: gathered and written as one replicated tensor, so its checksum
    # blocks are whole on every writer.
    states = world.mpi_comm.allgather(torch.get_rng_state().numpy())
    rng = Entry("rng/torch_cpu", (world.size, states[0].size), torch.uint8,
                torch.from_numpy(np.stack(states)))
    hist = Entry("train/losses", (len(losses),), torch.float64,
                 torch.tensor(losses, dtype=torch.float64))
    return [rng, hist]


def save_checkpoint(directory: str, step: int, par, world, cfg, sampler, losses, scaler=None,
                    keep: int = 0) -> str:
    """Write DIR/ckpt-STEP.h5 (collective over the world); keep the newest keep; return the path."""
    from hpctrain import __version__

    if world.rank == 0:
        os.makedirs(directory, exist_ok=True)
    world.mpi_comm.Barrier()
    final = manager.checkpoint_path(directory, step)
    attrs = {
        "format": FORMAT, "step": np.int64(step), "config_toml": cfg.to_toml(),
        "world_size": np.int64(world.size), "strategy": par.name,
        "hpctrain_version": __version__, "torch_version": str(torch.__version__),
        "sampler_state": json.dumps(sampler.state_dict()),
        "grad_scaler": json.dumps(scaler.state_dict() if scaler is not None else {}),
        **{k: json.dumps(v) for k, v in par.state_meta().items()},
    }
    entries = par.state_entries() + _run_entries(world, sampler, losses)
    write_entries(final, entries, attrs, world.mpi_comm)
    if world.rank == 0:
        manager.write_latest_pointer(directory, final)
        manager.prune(directory, keep)
    world.mpi_comm.Barrier()
    return final


def load_checkpoint(path: str, par, world, sampler, scaler=None) -> tuple[int, list[float]]:
    """Restore everything saved by save_checkpoint; return (step, losses). Collective."""
    reader = None
    try:
        reader = Reader(path)
    except CheckpointError as exc:
        errors = world.mpi_comm.allgather(str(exc))
        raise CheckpointError(errors[0]) from None
    with reader:
        world.mpi_comm.allgather(None)  # every rank opened it
        if reader.attrs.get("format") != FORMAT:
            reader.fail(f"attribute 'format' is {reader.attrs.get('format')!r}, expected {FORMAT!r}")
            reader.check(world.mpi_comm)
        par.load_state_entries(reader)
        saved_world = int(reader.attrs["world_size"])
        r = world.rank % saved_world  # more ranks than written: reuse the states round-robin
        rng = reader.read("rng/torch_cpu", rows=(r, r + 1))
        hist = reader.read("train/losses")
        reader.check(world.mpi_comm)
        torch.set_rng_state(torch.from_numpy(np.ascontiguousarray(rng[0])))
        sampler.load_state_dict(json.loads(reader.attrs["sampler_state"]))
        scaler_state = json.loads(reader.attrs["grad_scaler"])
        if scaler is not None and scaler_state:
            scaler.load_state_dict(scaler_state)
        return int(reader.attrs["step"]), [float(x) for x in hist]


def load_model_state(model: torch.nn.Module, path: str) -> None:
    """Load the model tensors of a checkpoint (or an export) into model, on this process only."""
    with Reader(path) as reader:
        with torch.no_grad():
            for key, t in model.state_dict(keep_vars=True).items():
                a = reader.read(f"model/{key}", tuple(t.shape))
                if a is None and not reader.has(f"model/{key}"):
                    aliases = json.loads(reader.attrs.get("model_aliases", "{}"))
                    if key in aliases:
                        reader.errors.pop()
                        continue
                if a is not None:
                    t.copy_(from_numpy(a, t.dtype).reshape(t.shape))
        reader.check()
