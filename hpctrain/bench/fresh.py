"""Run one measurement in FRESH processes: MPI_Comm_spawn as many ranks as the caller has.

Peak RSS is process-wide and never goes down, so two strategies measured in one process
would share a high-water mark; each one gets its own spawned world instead.
"""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["spawn", "serve"]

_TAG = 17


def spawn(comm, module: str, kwargs: dict) -> dict:
    """Run ``python -m module`` on comm.size new ranks; return the dict its rank 0 sent.

    Collective over comm. The callers wait by sleeping on a non-blocking receive, so they
    take no CPU from the children (a blocking MPI receive spins).
    """
    from mpi4py import MPI

    info = MPI.Info.Create()
    info.Set("map_by", ":OVERSUBSCRIBE")  # the caller's ranks already fill the cores
    info.Set("wdir", os.getcwd())
    inter = comm.Spawn(sys.executable, ["-m", module, json.dumps(kwargs)],
                       maxprocs=comm.Get_size(), info=info, root=0)
    req = inter.irecv(source=comm.Get_rank(), tag=_TAG)  # child i answers parent i
    while True:
        done, msg = req.test()
        if done:
            break
        time.sleep(0.05)
    inter.Disconnect()
    info.Free()
    msg = comm.bcast(msg if comm.Get_rank() == 0 else None)
    if "error" in msg:
        raise RuntimeError(f"{module} {kwargs}: {msg['error']}")
    return msg


def serve(fn) -> None:
    """Child side: call fn(**kwargs from argv) on every rank; send each rank's parent the
    result of rank 0 (or the first error), then leave."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise SystemExit(f"{sys.argv[0]}: started by hpctrain.bench.fresh.spawn only")
    world = MPI.COMM_WORLD
    try:
        out = fn(**json.loads(sys.argv[1]))
    except (RuntimeError, ValueError, OSError, ImportError) as e:  # reported by the caller
        out = {"error": f"rank {world.Get_rank()}: {type(e).__name__}: {e}"}
    errors = [o for o in world.allgather(out if "error" in out else None) if o]
    result = errors[0] if errors else world.bcast(out)
    parent.send(result, dest=world.Get_rank(), tag=_TAG)
    parent.Disconnect()
