"""The gloo process group that torch's baselines (DDP, FSDP2, tensor parallel, pipelining) run
over, started beside MPI on the same ranks and ended before exit."""

from __future__ import annotations

import gc
import os
import socket

import torch.distributed as dist

__all__ = ["destroy_gloo", "init_gloo"]


def init_gloo(world) -> None:
    """Start torch.distributed's gloo group over the world's ranks (collective)."""
    port = 0
    if world.rank == 0:  # a free port now, not a guess that an earlier run still holds
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(world.mpi_comm.bcast(port))
    dist.init_process_group("gloo", rank=world.rank, world_size=world.size)


def destroy_gloo(world) -> None:
    """End the gloo group so that its worker threads stop now: a thread still alive at
    interpreter exit may drop a tensor's Python object there and abort the process."""
    dist.barrier()  # every queued gloo op has run and let go of its tensors
    dist.destroy_process_group()
    gc.collect()  # the baselines' meshes and modules that still held the group
