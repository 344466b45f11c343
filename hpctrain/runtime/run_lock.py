"""Run-directory lock: one job at a time writes a run's directories.

Two jobs sharing ``--checkpoint-dir`` or ``--out-dir`` would interleave their checkpoints and
metrics.csv rows without a word, and a later ``--resume auto`` would continue the other job's
weights. So before the job writes any file, rank 0 creates ``.hpctrain-lock`` in each
directory it writes (once per directory), holding the job id, host, pid and start time, and
every rank learns the outcome together (one broadcast): a directory another run holds stops
the job on every rank with one line naming the holder and the fix.

The file is created exclusively by a hard link of a complete temporary file (the lock-file
recipe that works on NFS, Lustre and GPFS, where flock may be missing or node-local); a file
system without hard links gets ``O_CREAT | O_EXCL``. A lock whose holder is gone is taken
over: on the same host when its process no longer exists (a kill -9, a lost node rebooted);
from any host when it names the current batch job (a requeued SLURM/PBS job keeps its id);
and always with an explicit ``force``. The holder releases it at the end of the run, on an
error, a signal that reaches Python, and before MPI_Abort.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from hpctrain.errors import UsageError
from hpctrain.runtime import abort

__all__ = ["LOCK_NAME", "Holder", "RunLock", "RunLockError", "decide", "job_of",
           "process_alive", "take", "take_dirs"]

LOCK_NAME = ".hpctrain-lock"
# A lock file that cannot be read: still being created when younger than this, else left by
# a writer that died between creating and filling it (only the O_EXCL fallback can do that).
UNREADABLE_STALE_S = 60.0
# Rounds of read-judge-take when other jobs race for the same stale lock.
_ATTEMPTS = 8
# Hard links unsupported: fall back to O_CREAT | O_EXCL.
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)
_SCHEDULERS = (("SLURM_JOB_ID", "SLURM"), ("SLURM_JOBID", "SLURM"), ("PBS_JOBID", "PBS"),
               ("LSB_JOBID", "LSF"))


class RunLockError(UsageError):
    """Another run holds a directory this job would write (the message names it and the fix)."""


def job_of(env: Mapping[str, str]) -> str | None:
    """The batch job this process belongs to, e.g. 'SLURM job 4242'; None outside one."""
    for name, scheduler in _SCHEDULERS:
        value = (env.get(name) or "").strip()
        if value:
            return f"{scheduler} job {value}"
    return None


def _pid_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc; None where
    there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], fields[19]


def process_alive(pid: int, pid_start: str | None) -> bool:
    """Whether process ``pid`` of this host still runs; a zombie, or a reused pid (another
    start time), does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    stat = _pid_stat(pid)
    if stat is None:
        return True
    state, start = stat
    return state != "Z" and (pid_start is None or start == pid_start)


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock file as one JSON line."""

    host: str
    pid: int
    pid_start: str | None
    job: str | None
    since: float
    token: str

    @classmethod
    def here(cls, env: Mapping[str, str]) -> "Holder":
        """This process, now."""
        stat = _pid_stat(os.getpid())
        return cls(socket.gethostname(), os.getpid(), stat[1] if stat else None, job_of(env),
                   time.time(), uuid.uuid4().hex)

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes) -> "Holder | None":
        """The holder in a lock file's bytes; None when they are not one (incomplete, foreign)."""
        try:
            d = json.loads(raw.decode())
            return cls(str(d["host"]), int(d["pid"]), d.get("pid_start"), d.get("job"),
                       float(d["since"]), str(d["token"]))
        except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
            return None

    def describe(self) -> str:
        """'pid 4242 on host n01, SLURM job 77, since 2026-11-27 15:20:01 UTC'."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host}, {self.job or 'no batch job'}, since {when}"


@dataclass(frozen=True)
class Decision:
    """What to do with a lock another holder wrote: take it over (``note``: the warning to
    print, or "" to say nothing) or refuse (``note``: by whom the directory is in use)."""

    take: bool
    note: str


def decide(holder: Holder | None, me: Holder, *, force: bool, age_s: float,
           alive: Callable[[int, str | None], bool] = process_alive) -> Decision:
    """Judge an existing lock (pure but for ``alive``, asked only about this host's pids).

    ``holder`` None: the file is not a complete lock (being created, or its writer died).
    """
    if holder is None:
        if force or age_s > UNREADABLE_STALE_S:
            return Decision(True, f"its lock file is unreadable ({age_s:.0f} s old); taking "
                                  f"it over")
        return Decision(False, "by another run that is creating its lock right now")
    who = holder.describe()
    same_host = holder.host == me.host
    if same_host and holder.pid == me.pid and holder.pid_start == me.pid_start:
        return Decision(True, "")  # an earlier Trainer of this process that was not fitted
    if same_host and not alive(holder.pid, holder.pid_start):
        return Decision(True, f"the run holding it has ended ({who}); taking it over")
    if holder.job is not None and holder.job == me.job and not same_host:
        return Decision(True, f"held by an earlier run of this job ({who}; requeued); "
                              f"taking it over")
    if force:
        return Decision(True, f"--force-unlock: taking it over from {who}")
    if same_host:
        return Decision(False, f"by another run ({who}; still running)")
    return Decision(False, f"by another run ({who}; its host cannot be checked from here)")


def _fix(labels: str, holder: Holder | None, me: Holder) -> str:
    """The way out of a refusal: another directory; and where the holder may be gone, the
    override."""
    own = f"give this job its own {labels}" + (" (or --run-name auto)" if "--out-dir" in labels
                                               else "")
    if holder is not None and holder.host == me.host:
        return own + ", or wait for that run to end"
    return own + ", or, if that run has ended, rerun with --force-unlock (or delete the lock file)"


def _read(path: str) -> tuple[bytes, float] | None:
    """(bytes, age in seconds) of a file; None when it is gone."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
            age = time.time() - os.fstat(fh.fileno()).st_mtime
    except FileNotFoundError:
        return None
    return raw, age


def _create(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists (True: created). A hard link of a
    complete file is atomic on NFS too, and no reader ever sees a half-written lock."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LINKS:
            return _create_excl(path, data)
        # NFS may lose the reply of a link that was made: the link count tells.
        if os.stat(tmp).st_nlink == 2:
            return True
        raise
    finally:
        os.unlink(tmp)


def _create_excl(path: str, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return True


def _remove_if(path: str, raw: bytes) -> bool:
    """Remove the lock file if it still holds ``raw`` (the lock judged stale): moved aside
    first, so a lock another run took over meanwhile is put back, not deleted."""
    aside = f"{path}.{uuid.uuid4().hex}.stale"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    got = _read(aside)
    if got is not None and got[0] == raw:
        os.unlink(aside)
        return True
    try:
        os.link(aside, path)
    except FileExistsError:
        pass
    os.unlink(aside)
    return False


def _take_one(directory: str, labels: str, me: Holder, force: bool, alive, say) -> str:
    """Take the lock of one directory (made if missing); return its path or raise
    RunLockError."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    data = me.to_bytes()
    for _ in range(_ATTEMPTS):
        if _create(path, data):
            return path
        got = _read(path)
        if got is None:
            continue  # released meanwhile: try again
        holder = Holder.parse(got[0])
        verdict = decide(holder, me, force=force, age_s=got[1], alive=alive)
        if not verdict.take:
            raise RunLockError(f"{labels} {directory} is in use {verdict.note}; lock file "
                               f"{path}; {_fix(labels, holder, me)}")
        if _remove_if(path, got[0]) and verdict.note:
            say(f"hpctrain: warning: {labels} {directory}: {verdict.note}")
    raise RunLockError(f"{labels} {directory}: its lock {path} kept changing hands (several "
                       f"runs are starting on it at once); give this job its own {labels}")


class RunLock:
    """The locks rank 0 holds (none on other ranks); ``release()`` removes them (once, and
    only while they are still this holder's)."""

    def __init__(self, paths: Sequence[str] = (), token: str = ""):
        self.paths, self.token = list(paths), token
        if self.paths:
            atexit.register(self.release)
            abort.BEFORE_ABORT.append(self.release)  # MPI_Abort runs no atexit

    def release(self) -> None:
        paths, self.paths = self.paths, []
        for path in paths:
            got = _read(path)
            holder = Holder.parse(got[0]) if got else None
            if holder is not None and holder.token == self.token:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if paths and self.release in abort.BEFORE_ABORT:
            abort.BEFORE_ABORT.remove(self.release)
            atexit.unregister(self.release)


def take_dirs(dirs: Sequence[tuple[str, str]], me: Holder, force: bool = False,
              alive=process_alive, say=print) -> RunLock:
    """Lock every directory of ``dirs`` ((flag, path) pairs; empty paths skipped; a directory
    named twice locked once) in a fixed order, so two runs never each hold one of the other's;
    on a refusal release the ones taken and raise RunLockError. No communication."""
    by_real: dict[str, tuple[str, list[str]]] = {}
    for label, path in dirs:
        if path:
            shown, labels = by_real.setdefault(os.path.realpath(path), (path, []))
            if label not in labels:
                labels.append(label)
    taken: list[str] = []
    try:
        for real in sorted(by_real):
            shown, labels = by_real[real]
            taken.append(_take_one(shown, " and ".join(labels), me, force, alive, say))
    except BaseException:
        RunLock(taken, me.token).release()
        raise
    return RunLock(taken, me.token)


def take(dirs: Sequence[tuple[str, str]], mpi_comm, force: bool = False,
         env: Mapping[str, str] | None = None) -> RunLock:
    """Rank 0 locks ``dirs`` (take_dirs) and tells every rank: all return, or all raise the
    same RunLockError. Collective over ``mpi_comm`` (an mpi4py communicator)."""
    lock, refusal = RunLock(), None
    if mpi_comm.Get_rank() == 0:
        me = Holder.here(os.environ if env is None else env)
        try:
            lock = take_dirs(dirs, me, force, say=lambda line: print(line, flush=True))
        except RunLockError as exc:
            refusal = str(exc)
        except OSError as exc:
            refusal = (f"cannot lock {exc.filename or 'a run directory'}: {exc.strerror}; pass "
                       f"directories this job can write")
        sys.stdout.flush()
    if mpi_comm.Get_size() > 1:
        refusal = mpi_comm.bcast(refusal, root=0)  # once per run: a pickled string is fine
    if refusal is not None:
        raise RunLockError(refusal)
    return lock
