"""A save as a transaction: claim the temporary name, write, agree, then commit or discard.

Every outcome is agreed over the communicator before any rank raises, so one rank's full
disk fails the save on every rank together instead of leaving the others in a collective.
A failed save deletes its partial file. A save that died (a killed rank) leaves a temporary
file behind; rank 0 holds an flock on the temporary file while its save runs, so at the next
start ``clean_stale`` removes exactly the temporary files that no running save holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sys
import time

from hpctrain.checkpoint import manager
from hpctrain.checkpoint.layout import Entry, numel, storage_dtype
from hpctrain.checkpoint.reader import CheckpointError, raise_agreed
from hpctrain.checkpoint.serial_fallback import (drop_unused_parts, parts_dir, use_serial,
                                                 write_serial)
from hpctrain.checkpoint.writer import SaveSteps, write_parallel

__all__ = ["write_entries", "clean_stale", "STALE_AGE_S", "CLAIM_WAIT_S"]

# Where the file system has no locks: a temporary file untouched this long is a dead save's.
STALE_AGE_S = 3600
# How long a save waits for a cleanup to let go of its temporary name (milliseconds' work).
CLAIM_WAIT_S = 10.0
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_MB = 1 << 20


def _lock(fd: int) -> bool | None:
    """Take an exclusive lock on fd without waiting: True taken, False held by a live save,
    None when the file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        st, fst = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _open_locked(tmp: str, wait: float) -> tuple[int, bool | None] | None:
    """Open (creating) tmp and lock it, waiting up to wait seconds for a holder to let go.

    (fd, True): locked; (fd, None): the file system has no locks; None: a running save holds
    it. A lock on a file that was deleted meanwhile is no claim on the name: open again.
    """
    deadline = time.monotonic() + wait
    while True:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
        got = _lock(fd)
        if got is None or (got and _same_file(fd, tmp)):
            return fd, got
        os.close(fd)
        if got is False and time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


class _Claim:
    """Rank 0's lock on a save's temporary file: while it is held no cleanup deletes the file.

    The lock belongs to this open file, not to the name, so it follows the rename to the
    final name and ends when the claim is closed (or the process dies).
    """

    def __init__(self, tmp: str):
        opened = _open_locked(tmp, CLAIM_WAIT_S)
        if opened is None:
            raise CheckpointError(
                f"{tmp} is being written by another save right now (another job saving the "
                f"same step into this directory); give each job its own --checkpoint-dir")
        self.fd = opened[0]

    def close(self) -> None:
        os.close(self.fd)


def _nbytes(entries: list[Entry]) -> int:
    """Bytes the file will take: the tensors plus room for HDF5's metadata, which is flushed
    at close (a flush that fails there is the hardest failure to recover from)."""
    data = sum(numel(tuple(e.shape)) * storage_dtype(e.dtype).itemsize for e in entries)
    return data + 64 * 1024 + 4 * 1024 * len(entries)  # a dataset's header: about 1 KiB


def _free_bytes(directory: str) -> int | None:
    try:
        usage = shutil.disk_usage(directory or ".")
    except OSError:
        return None
    return usage.free if usage.total else None  # some file systems report nothing


def _allocated(final: str) -> int:
    """Bytes on disk of final's temporary file and part files (what a failed save wrote)."""
    paths = [manager.tmp_path(final)]
    for root, _, names in os.walk(parts_dir(final)):
        paths += [os.path.join(root, n) for n in names]
    total = 0
    for p in paths:
        with contextlib.suppress(OSError):
            total += os.stat(p).st_blocks * 512
    return total


def _mb(nbytes: int) -> str:
    return f"{max(nbytes / _MB, 0.1):.1f}" if nbytes < 10 * _MB else f"{nbytes // _MB:,d}"


def _disk_full(exc: OSError, final: str, needed: int) -> str | None:
    """'no space left on device' or 'disk quota exceeded' when that is why exc happened.

    MPI-IO drops errno ("Can't write data"), so a file system without room for the whole
    file (what it holds now plus what the save wrote before failing) counts as full.
    """
    text = str(exc).lower()
    if exc.errno == errno.EDQUOT or "quota" in text:
        return "disk quota exceeded"
    if exc.errno == errno.ENOSPC or "no space left" in text:
        return "no space left on device"
    free = _free_bytes(os.path.dirname(final))
    if free is not None and (free < _MB or free + _allocated(final) < needed):
        return "no space left on device"
    return None


def _failure(exc: OSError, final: str, needed: int) -> str:
    """The one-line reason a write to final failed; a full disk or quota is said plainly."""
    why = _disk_full(exc, final, needed)
    if why is None:
        return f"checkpoint write to {final} failed: {' '.join(str(exc.strerror or exc).split())}"
    free = _free_bytes(os.path.dirname(final))
    room = "" if free is None else f", {_mb(free)} MB free"
    return (f"checkpoint write to {final} failed: {why} (needed ~{_mb(needed)} MB{room}); free "
            f"space (or lower checkpoint.keep) and resume")


def _check_space(final: str, needed: int) -> None:
    """Fail before writing anything when the file system has less room than the file needs."""
    free = _free_bytes(os.path.dirname(final))
    if free is not None and free < needed:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _claim(tmp: str, final: str, needed: int, comm) -> _Claim | None:
    """Rank 0 checks the free space and claims tmp; any failure raises on every rank."""
    claim, err = None, None
    if comm.Get_rank() == 0:
        try:
            _check_space(final, needed)
            claim = _Claim(tmp)
        except CheckpointError as exc:
            err = str(exc)
        except OSError as exc:
            err = _failure(exc, final, needed)
    raise_agreed(comm, err)
    return claim


def _write(tmp: str, final: str, entries: list[Entry], attrs: dict, comm, needed: int,
           steps: SaveSteps):
    """Write tmp with the parallel or the serial writer; this rank's failure message or None."""
    try:
        if use_serial(comm.Get_rank()):
            write_serial(tmp, final, entries, attrs, comm, steps)
        else:
            write_parallel(tmp, entries, attrs, comm, steps)
    except OSError as exc:
        return _failure(exc, final, needed)
    return None


def _commit(tmp: str, final: str, comm, needed: int) -> None:
    """Rank 0 flushes tmp to the disk and renames it to final; a failure raises everywhere."""
    comm.Barrier()  # every rank closed (and so flushed) the file
    err = None
    if comm.Get_rank() == 0:
        try:
            with open(tmp, "rb+") as fh:
                # give back the room reserved for the closing flush (writer.reserve) that it
                # did not use: blocks past the end stay allocated until a truncation
                os.ftruncate(fh.fileno(), os.fstat(fh.fileno()).st_size)
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            err = _failure(exc, final, needed)
    raise_agreed(comm, err)


def _discard(tmp: str, final: str) -> None:
    """Delete what a failed save wrote (rank 0, while it still holds the claim)."""
    try:
        os.remove(tmp)
    except FileNotFoundError:
        pass
    except OSError as exc:
        print(f"hpctrain: warning: could not delete the partial checkpoint {tmp}: {exc}",
              file=sys.stderr, flush=True)
    drop_unused_parts(final)


def write_entries(final: str, entries: list[Entry], attrs: dict, comm) -> None:
    """Write entries to final via its temporary name, then rename (collective over comm).

    Raises CheckpointError on every rank when the write fails on any rank (a full disk says
    so, with the size needed); nothing of the failed save is left behind.
    """
    tmp, needed = manager.tmp_path(final), _nbytes(entries)
    # Every step is in the flight recorder: a rank stuck in one is seen by the watchdog.
    with SaveSteps(comm, needed) as steps:
        with steps("claim"):
            claim = _claim(tmp, final, needed, comm)
        try:
            err = _write(tmp, final, entries, attrs, comm, needed, steps)
            with steps("result"):
                raise_agreed(comm, err)
            with steps("commit"):  # rank 0 syncs and renames, the others wait for its word
                _commit(tmp, final, comm, needed)
            if claim is not None:
                drop_unused_parts(final)  # the parts of the master this one replaced
        except BaseException:
            if claim is not None:
                _discard(tmp, final)
            raise
        finally:
            if claim is not None:
                claim.close()


def _clean_step(final: str) -> list[str]:
    """Remove what a dead save of final left (nothing while a running save holds its claim)."""
    tmp = manager.tmp_path(final)
    try:
        existed = os.stat(tmp).st_mtime
    except FileNotFoundError:
        existed = None
    opened = _open_locked(tmp, wait=0.0)
    if opened is None:
        return []  # a running save
    fd, locked = opened
    try:
        # Without locks only an old temporary file is surely a dead save's.
        dead = locked or (existed is not None and time.time() - existed > STALE_AGE_S)
        removed = drop_unused_parts(final) if dead else []
        if dead or existed is None:  # a file this cleanup created goes too
            os.remove(tmp)
        return ([tmp] if dead and existed is not None else []) + removed
    except FileNotFoundError:
        return []
    finally:
        os.close(fd)


def _clean(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    bases = sorted({m.group(1) for n in names if (m := manager.STALE_NAME.match(n))})
    return [p for base in bases for p in _clean_step(os.path.join(directory, base))]


def clean_stale(directory: str, comm) -> list[str]:
    """Remove what saves that died left in directory (collective; rank 0 works, and says so).

    Only temporary files that no running save holds a lock on are removed, so this is safe
    while another job sharing the directory is in the middle of a save.
    """
    removed = []
    if comm.Get_rank() == 0 and directory:
        try:
            removed = _clean(directory)
        except OSError as exc:  # tidying up must not stop a run
            print(f"hpctrain: warning: could not clean {directory}: {exc}", file=sys.stderr,
                  flush=True)
        for path in removed:
            print(f"hpctrain: removed {path}, left by a checkpoint save that did not finish",
                  file=sys.stderr, flush=True)
    return comm.bcast(removed)
