"""Checkpoint names in a directory: temporary names, the newest complete one, keep-last-K.

Two jobs may share a directory (a requeued job and its successor, array jobs): another job
can remove or add files between a listing and its use, so nothing here fails on a file that
vanished, and the `latest` pointer is written through a name of this process's own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket

__all__ = ["checkpoint_path", "tmp_path", "list_checkpoints", "latest", "prune",
           "write_latest_pointer", "STALE_NAME"]

_NAME = re.compile(r"^ckpt-(\d{6,})\.h5$")
# What a save that did not finish can leave: the temporary file and the serial part files.
STALE_NAME = re.compile(r"^(ckpt-\d{6,}\.h5)\.(?:tmp|parts)$")


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"ckpt-{step:06d}.h5")


def tmp_path(final: str) -> str:
    """Name written to until the save is complete (never matches the scan)."""
    return final + ".tmp"


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in directory, oldest first."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((int(m.group(1)), os.path.join(directory, n))
                  for n in names if (m := _NAME.match(n)))


def latest(directory: str) -> str | None:
    """Path of the newest complete checkpoint in directory, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def write_latest_pointer(directory: str, path: str) -> None:
    """Write DIR/latest (the newest file name) atomically, for people and scripts."""
    tmp = os.path.join(directory, f"latest.tmp.{socket.gethostname()}.{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(os.path.basename(path) + "\n")
        os.replace(tmp, os.path.join(directory, "latest"))
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def prune(directory: str, keep: int, written: str | None = None) -> list[str]:
    """Delete all but the newest keep checkpoints (keep <= 0 keeps all); never raises.

    ``written``: the checkpoint just saved, never deleted (a file named for a higher step,
    copied or renamed into the directory, would otherwise outrank it). Returns what could
    not be deleted, with why; a file already gone (another job sharing the directory pruned
    it) is not a problem.
    """
    if keep <= 0:
        return []
    problems = []
    for _, path in list_checkpoints(directory)[:-keep]:
        if path == written:
            continue
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
        shutil.rmtree(path + ".parts", ignore_errors=True)
    return problems
