"""Pre-emption: a signal sets a flag, all ranks agree at a step boundary, checkpoint, go.

Schedulers warn a job before they stop it: SLURM sends ``--signal=USR1@90`` ahead of the
time limit and SIGTERM at it (then SIGKILL after KillWait); PBS sends SIGTERM on ``qdel``
and pre-emption. The signal reaches ranks at different moments (or only some of them), so
a rank never acts on its own flag: at every step boundary the ranks take the max of their
flags (one scalar all-reduce) and all stop after the same step. The trainer then writes a
checkpoint and calls ``finish()``, which under a SLURM batch job runs
``scontrol requeue $SLURM_JOB_ID`` (the job starts again later and ``--resume auto`` picks
up the checkpoint) and raises ``Preempted``; ``python -m hpctrain`` turns that into exit
code ``PREEMPT_EXIT_CODE`` on every rank.

SIGTERM comes with a deadline: SIGKILL follows after the launcher's grace period (Open
MPI's mpirun: ``odls_base_sigkill_timeout``, 1 s by default; SLURM: KillWait, 30 s by
default; PBS: kill_delay, 10 s by default). A save that cannot finish in what is left is
not started (a killed save would only leave a partial file); with a grace too short for
even the current step, the rank exits 75 from the signal handler at once. mpirun sends that
SIGTERM only ``odls_base_sigkill_timeout`` seconds after its own (SIGCONT first, SIGKILL as
long again after), and reads none of the ranks' output meanwhile: from SIGTERM on, output
that would block a rank is dropped (``train/stdio.py``) so the stop step is still reached.

Exit code 75 (EX_TEMPFAIL, "temporary failure, try again") means: stopped on a signal; the
newest checkpoint on disk (of the last step when there was time to write it) is where
``--resume auto`` continues.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping

from hpctrain.train.stdio import UnstalledOutput

__all__ = ["PREEMPT_EXIT_CODE", "PREEMPT_SIGNALS", "Preempted", "Preemption",
           "requeue_command", "sigterm_grace_s", "SHORT_GRACE_S"]

PREEMPT_EXIT_CODE = 75
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# Below this many seconds between SIGTERM and SIGKILL a step boundary is out of reach.
SHORT_GRACE_S = 2.0
# Launchers' defaults for the SIGTERM -> SIGKILL delay, when nothing says otherwise.
_DEFAULT_GRACE_S = {"openmpi": 1.0, "slurm": 30.0, "pals": 10.0}


def sigterm_grace_s(launcher: str, env: Mapping[str, str], configured: float = 0.0
                    ) -> float | None:
    """Seconds between SIGTERM and SIGKILL for this launch (None: no known deadline).

    ``configured`` (checkpoint.sigterm_grace_s) wins; under Open MPI the value mpirun was
    given (``--mca odls_base_sigkill_timeout N`` reaches the ranks as an environment
    variable), else the launcher's default.
    """
    if configured > 0:
        return configured
    if launcher == "openmpi":
        raw = (env.get("OMPI_MCA_odls_base_sigkill_timeout") or "").strip()
        try:
            return float(raw) if raw else _DEFAULT_GRACE_S["openmpi"]
        except ValueError:
            return _DEFAULT_GRACE_S["openmpi"]
    return _DEFAULT_GRACE_S.get(launcher)


class Preempted(Exception):
    """Training stopped early on a signal; ``path`` is the newest checkpoint (None: none).

    ``saved`` says whether ``path`` holds ``step`` itself (False: no time to write it).
    """

    def __init__(self, step: int, path: str | None, signal_name: str, requeued: bool,
                 saved: bool = True):
        self.step, self.path, self.signal_name, self.requeued = step, path, signal_name, requeued
        self.saved = saved
        what = "job requeued" if requeued else "rerun with --resume auto to continue"
        where = f"checkpoint of step {step} in {path}" if saved else \
            f"no time to save step {step}; newest checkpoint: {path or 'none'}"
        super().__init__(f"pre-empted by {signal_name}: {where}; {what}")


def requeue_command(env: Mapping[str, str]) -> list[str] | None:
    """The command that requeues this job, or None when not in a SLURM batch job."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    return ["scontrol", "requeue", job] if job else None


class Preemption:
    """Signal flag + the per-step agreement. Use as a context manager around the loop.

    Handlers are installed only from the main thread (Python's rule); elsewhere the flag
    simply never rises. A second SIGTERM while already stopping restores the default action
    and re-delivers it, so a user who insists still stops a hung job.
    """

    def __init__(self, requeue: str = "auto", signals=PREEMPT_SIGNALS,
                 env: Mapping[str, str] | None = None, grace_s: float | None = None):
        self.requeue = requeue
        self.signals = tuple(signals)
        self.env = os.environ if env is None else env
        self.grace_s = grace_s          # SIGTERM -> SIGKILL delay; None: no known deadline
        self.received: int | None = None
        self.term_at: float | None = None
        self._previous: dict[int, object] = {}
        self.output = UnstalledOutput()

    def install(self) -> "Preemption":
        """Install the signal handlers (main thread only) and return self."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            if signal.SIGTERM in self.signals:
                self.output.install()
        return self

    def restore(self) -> None:
        """Put back the handlers that were there before install()."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.output.restore()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _on_signal(self, signum, frame) -> None:
        if self.received == signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGTERM and self.term_at is None:
            self.term_at = time.monotonic()
            # The launcher may not read our output until SIGKILL (mpirun): never block on it
            # again; a write this signal interrupted is retried non-blocking.
            self.output.switch()
            if self.grace_s is not None and self.grace_s < SHORT_GRACE_S:
                # SIGKILL follows before any step boundary: leave now with the code that
                # says "resume from the newest checkpoint", rather than die mid-save.
                sys.stderr.write(f"hpctrain: SIGTERM with {self.grace_s:g} s until SIGKILL: no "
                                 f"time to checkpoint; exiting {PREEMPT_EXIT_CODE} (give mpirun "
                                 "--mca odls_base_sigkill_timeout 60 for a checkpoint)\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(PREEMPT_EXIT_CODE)
        if self.received is None:
            self.received = signum

    def time_left_s(self) -> float:
        """Seconds until SIGKILL after a SIGTERM (inf when no deadline is known or pending)."""
        if self.term_at is None or self.grace_s is None:
            return float("inf")
        return self.grace_s - (time.monotonic() - self.term_at)

    def should_stop(self, comm) -> bool:
        """True on every rank once any rank got a signal (collective over comm's ranks)."""
        flag = 0.0 if self.received is None else float(self.received)
        agreed = comm.allreduce_scalars([flag], op="max")[0]
        if agreed and self.received is None:
            self.received = int(agreed)
        return agreed > 0

    def finish(self, step: int, path: str | None, comm, saved: bool = True) -> None:
        """After the checkpoint: rank 0 requeues (SLURM job); every rank raises Preempted.

        Collective over comm's ranks: the others wait at a barrier until the requeue is
        done, so no rank exits early (with KillOnBadExit an early exit 75 would make srun
        kill rank 0 before it could requeue).
        """
        name = signal.Signals(self.received).name if self.received else "signal"
        requeued = False
        cmd = requeue_command(self.env) if self.requeue == "auto" else None
        if comm.rank == 0:
            what = f"checkpoint {path}" if saved else \
                f"no time to save it (newest checkpoint: {path or 'none'})"
            # Where it can still be read: stdout may have been dropped (train/stdio.py).
            out = sys.stderr if 1 in self.output.dropped else sys.stdout
            print(f"hpctrain: {name} received; stopped after step {step}, {what}", file=out,
                  flush=True)
            if cmd is not None:
                requeued = _run_requeue(cmd)
        comm.barrier()
        raise Preempted(step, path, name, requeued, saved)


def _run_requeue(cmd: list[str]) -> bool:
    """Run scontrol requeue; print why not when it fails (e.g. a job without --requeue)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"hpctrain: {' '.join(cmd)} failed ({exc}); resubmit with --resume auto",
              file=sys.stderr, flush=True)
        return False
    if proc.returncode != 0:
        print(f"hpctrain: {' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}; "
              f"submit the job with --requeue, or resubmit it with --resume auto",
              file=sys.stderr, flush=True)
        return False
    print(f"hpctrain: {' '.join(cmd)}: job requeued; it continues from the checkpoint",
          flush=True)
    return True
