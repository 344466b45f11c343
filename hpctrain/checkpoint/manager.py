"""Checkpoint names in a directory: temporary names, the newest complete one, keep-last-K."""

from __future__ import annotations

import os
import re
import shutil

__all__ = ["checkpoint_path", "tmp_path", "list_checkpoints", "latest", "resolve_resume",
           "prune", "write_latest_pointer"]

_NAME = re.compile(r"^ckpt-(\d{6,})\.h5$")


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"ckpt-{step:06d}.h5")


def tmp_path(final: str) -> str:
    """Name written to until the save is complete (never matches the scan)."""
    return final + ".tmp"


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints in directory, oldest first."""
    if not os.path.isdir(directory):
        return []
    out = [(int(m.group(1)), os.path.join(directory, n))
           for n in os.listdir(directory) if (m := _NAME.match(n))]
    return sorted(out)


def latest(directory: str) -> str | None:
    """Path of the newest complete checkpoint in directory, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def resolve_resume(resume: str, directory: str) -> str | None:
    """The checkpoint to resume from: '' none, 'auto' newest in directory (or None), else a path."""
    if not resume:
        return None
    if resume == "auto":
        return latest(directory) if directory else None
    if not os.path.isfile(resume):
        raise FileNotFoundError(f"checkpoint.resume = {resume!r} does not exist; pass an existing "
                                f"ckpt-*.h5 file or 'auto'")
    return resume


def write_latest_pointer(directory: str, path: str) -> None:
    """Write DIR/latest (the newest file name) atomically, for people and scripts."""
    tmp = os.path.join(directory, "latest.tmp")
    with open(tmp, "w") as fh:
        fh.write(os.path.basename(path) + "\n")
    os.replace(tmp, os.path.join(directory, "latest"))


def prune(directory: str, keep: int) -> None:
    """Delete all but the newest keep checkpoints (keep <= 0 keeps all)."""
    if keep <= 0:
        return
    for _, path in list_checkpoints(directory)[:-keep]:
        os.remove(path)
        shutil.rmtree(path + ".parts", ignore_errors=True)
