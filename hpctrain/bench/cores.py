"""The bench ranks and the host's cores: wait without taking a core, and say when ranks compete.

A timed bench is only as good as the cores its ranks run on: ``idle_barrier`` lets the ranks
that wait (a one-rank reference, ranks outside a pipeline) sleep instead of spinning in MPI,
and ``shared_cores`` tells the report when ranks share cores, so slow figures are read as such.
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["idle_barrier", "shared_cores"]


def idle_barrier(world) -> None:
    """A barrier over the world that sleeps between polls (collective over all ranks)."""
    req = world.mpi_comm.Ibarrier()  # a blocking barrier would spin and steal the cores
    while not req.Test():
        time.sleep(0.005)


def shared_cores(world) -> str:
    """'' when every rank of a node may run on its own cores; otherwise why ranks compete
    (collective over the node)."""
    n = 1024  # CPU ids covered by the bitmap
    mine = torch.zeros(1, n, dtype=torch.uint8)
    mine[0, [c for c in os.sched_getaffinity(0) if c < n]] = 1
    masks = world.node.allgather(mine).bool()
    cpus = int(masks.any(0).sum())
    if world.node.size > cpus:
        return f"{world.node.size} ranks on {cpus} cores: ranks share cores (oversubscribed)"
    if any(bool((masks[i] & masks[j]).any()) for i in range(len(masks))
           for j in range(i + 1, len(masks))):
        return ("ranks are not bound and may share cores (mpirun --bind-to core pins them "
                "when the machine is yours)")
    return ""
