"""Abort the whole MPI job when one rank fails, after its traceback is printed.

Without this an exception on one rank leaves the others blocked in a collective forever
(the 3 a.m. page). Same approach as ``python -m mpi4py``: print first, then MPI_Abort.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

__all__ = ["rank_label", "abort_on_exception", "report_and_abort"]


def _mpi_world():
    """Return (rank, size) from MPI if it is initialised, else None (never initialises it)."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None or not mod.Is_initialized() or mod.Is_finalized():
        return None
    return mod.COMM_WORLD.Get_rank(), mod.COMM_WORLD.Get_size()


def rank_label() -> str:
    """Describe this rank for error messages: 'rank R/N on HOST'."""
    world = _mpi_world()
    if world is None:
        from hpctrain.runtime.launcher import detect_launcher
        try:
            info = detect_launcher(os.environ)
            world = (info.rank, info.size)
        except ValueError:
            world = (0, 1)
    return f"rank {world[0]}/{world[1]} on {socket.gethostname()}"


def report_and_abort(exc: BaseException, code: int = 1) -> None:
    """Print the rank and traceback to stderr, then abort every rank of the job."""
    msg = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(f"[hpctrain {rank_label()}] unhandled {type(exc).__name__}: {exc}\n{msg}")
    sys.stderr.flush()
    sys.stdout.flush()
    world = _mpi_world()
    if world is not None and world[1] > 1:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(code)
    os._exit(code)


def abort_on_exception(fn, *args, **kwargs):
    """Call fn; on an unhandled exception print it with the rank and abort the job.

    SystemExit passes through: a clean ``sys.exit(2)`` that every rank takes the same way
    (bad config) must not turn into an abort.
    """
    try:
        return fn(*args, **kwargs)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt must abort too
        report_and_abort(exc)
