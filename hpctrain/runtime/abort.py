"""End the whole MPI job when ranks fail, so no rank is left waiting in a collective.

Without this an exception on one rank leaves the others blocked in a collective forever
(the 3 a.m. page). Two paths:

- a bug (any unexpected exception): print the rank, the step and the traceback, then
  MPI_Abort, as ``python -m mpi4py`` does (``abort_on_exception``, ``install_excepthook``);
- a user error with a clear sentence (bad device, data set too small, corrupt checkpoint):
  ``fail_together`` waits briefly for the other ranks on a communicator used for nothing
  else. If every rank reports an error, rank 0 prints each distinct sentence once and all
  exit cleanly with the code; if some rank never comes (it is blocked elsewhere, or raised
  nothing), this rank prints its sentence and aborts the job.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

__all__ = ["rank_label", "abort_on_exception", "report_and_abort", "install_excepthook",
           "arm_agreement", "fail_together", "set_context", "FAIL_AGREE_TIMEOUT_S"]

# How long ranks that raised the same error may lag each other before it counts as one rank's.
FAIL_AGREE_TIMEOUT_S = 15.0

_agree_comm = None      # mpi4py communicator duplicated at init, used only by fail_together
_context: dict = {}     # what the job is doing, named in abort reports (e.g. {"step": 12})


def _mpi():
    """The mpi4py.MPI module if MPI is initialised and not finalised, else None."""
    mod = sys.modules.get("mpi4py.MPI")
    if mod is None or not mod.Is_initialized() or mod.Is_finalized():
        return None
    return mod


def _mpi_world():
    """Return (rank, size) from MPI if it is initialised, else None (never initialises it)."""
    mod = _mpi()
    return None if mod is None else (mod.COMM_WORLD.Get_rank(), mod.COMM_WORLD.Get_size())


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


def set_context(**items) -> None:
    """Record what this rank is doing (e.g. step=12); abort reports name it. None removes."""
    for key, value in items.items():
        if value is None:
            _context.pop(key, None)
        else:
            _context[key] = value
    if "phase" in items:
        from hpctrain.runtime.timeline import TIMELINE

        if TIMELINE.enabled:  # --trace: phases are spans on the rank's timeline
            TIMELINE.phase(items["phase"])


def _where() -> str:
    # The phase (forward/backward/...) is for flight records; the traceback already shows it.
    return "".join(f" at {k} {v}" for k, v in _context.items() if k != "phase")


#: Called (no arguments, errors ignored) before this rank aborts the job: the watchdog
#: removes its channel directory (unless a stall is being reported from it), which MPI_Abort
#: would leave behind (os._exit runs no atexit).
BEFORE_ABORT: list = []


def _abort(code: int) -> None:
    """MPI_Abort when other ranks exist, else a plain exit; never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    for hook in list(BEFORE_ABORT):  # a copy: a hook may unregister itself (run_lock)
        try:
            hook()
        except Exception:  # noqa: BLE001 - the abort must happen whatever a hook does
            pass
    mod = _mpi()
    if mod is not None and mod.COMM_WORLD.Get_size() > 1:
        mod.COMM_WORLD.Abort(code)
    os._exit(code)


def report_and_abort(exc: BaseException, code: int = 1) -> None:
    """Print the rank, the step and the traceback to stderr, then abort every rank of the job."""
    msg = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(f"[hpctrain {rank_label()}{_where()}] unhandled {type(exc).__name__}: "
                     f"{exc}\n{msg}")
    _abort(code)


def _user_error(exc: BaseException) -> bool:
    from hpctrain.errors import UserInputError

    return isinstance(exc, UserInputError)


def abort_on_exception(fn, *args, **kwargs):
    """Call fn; on an unhandled exception print it with the rank and abort the job.

    SystemExit passes through: a clean ``sys.exit(2)`` that every rank takes the same way
    (bad config) must not turn into an abort. An error in what the user gave
    (hpctrain.errors.UserInputError) is one line through ``fail_together``: exit 1 when
    every rank raised it, else this rank is named and the job aborted.
    """
    try:
        return fn(*args, **kwargs)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt must abort too
        if _user_error(exc):
            raise SystemExit(fail_together(_one_line(exc))) from None
        report_and_abort(exc)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def install_excepthook() -> None:
    """End the job on any exception that reaches the top of a user's script (Python API):
    a bug prints its traceback and aborts every rank; an error in what the user gave
    (UserInputError: a config value, a model the plan cannot run) raised on every rank is
    one ``hpctrain: error:`` line from rank 0, and the interpreter exits (code 1) as
    usual; raised on some ranks only, it names the rank and aborts."""
    if getattr(sys.excepthook, "_hpctrain", False):
        return

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, SystemExit):
            return sys.__excepthook__(exc_type, exc, tb)
        if _user_error(exc):
            fail_together(_one_line(exc))
            return None
        report_and_abort(exc.with_traceback(tb))

    hook._hpctrain = True
    sys.excepthook = hook


def arm_agreement(mpi_comm) -> None:
    """Give fail_together its own communicator (collective over mpi_comm; once per process)."""
    global _agree_comm
    if _agree_comm is None:
        _agree_comm = mpi_comm.Dup()


def fail_together(message: str, code: int = 1, timeout_s: float = FAIL_AGREE_TIMEOUT_S) -> int:
    """Report a user error raised after MPI started; return code, or abort the job.

    Call it on every rank that raised. When all ranks arrive within timeout_s, rank 0
    prints each distinct message once (naming the ranks when they differ) and every rank
    returns code. Otherwise this rank prints its message with its rank and aborts.
    """
    comm = _agree_comm
    if comm is None or comm.Get_size() == 1:
        print(f"hpctrain: error: {message}", file=sys.stderr, flush=True)
        return code
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout_s
    while not request.Test():
        if time.monotonic() > deadline:
            print(f"hpctrain: error: rank {comm.Get_rank()}{_where()}: {message} (the other "
                  f"ranks did not stop with it; aborting the job)", file=sys.stderr, flush=True)
            _abort(code)
        time.sleep(0.01)
    messages = comm.gather(message, root=0)
    if comm.Get_rank() == 0:
        ranks: dict[str, list[int]] = {}
        for r, m in enumerate(messages):
            ranks.setdefault(m, []).append(r)
        for m, rs in ranks.items():
            who = "" if len(ranks) == 1 else f"rank{'s' if len(rs) > 1 else ''} " \
                f"{', '.join(map(str, rs))}: "
            print(f"hpctrain: error: {who}{m}", file=sys.stderr, flush=True)
    comm.Barrier()  # rank 0 has printed before any rank exits (a launcher may kill the rest)
    return code
