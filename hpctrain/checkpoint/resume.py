"""Choose the checkpoint to resume from once, on rank 0, and make every rank agree on it.

Each rank listing the directory itself goes wrong: with a lagging shared file system (or
node-local directories) ranks picked different steps and the job hung; and a corrupt newest
checkpoint stopped every requeued restart. Here rank 0 lists, newest first; all ranks verify
each candidate together (every rank opens it, each checks its share of the checksums) and a
damaged one is skipped with the reason. A rank that cannot open the file rank 0 can open
stops the job on every rank: the directory is not shared.
"""

from __future__ import annotations

import os
import sys

from hpctrain.checkpoint.manager import list_checkpoints
from hpctrain.checkpoint.meta import meta_crc
from hpctrain.checkpoint.reader import CheckpointError, Reader, raise_agreed
from hpctrain.checkpoint.state import attr_problems

__all__ = ["resolve_resume"]


def _agree_exists(path: str, comm) -> None:
    err = None if os.path.isfile(path) else (
        f"rank {comm.Get_rank()}: checkpoint.resume = {path!r} does not exist; pass an existing "
        f"ckpt-*.h5 file (on a file system every rank sees) or 'auto'")
    raise_agreed(comm, err)


def _open_agreed(path: str, comm) -> tuple[Reader | None, str | None]:
    """(reader, None) when every rank opened path; (None, why) when rank 0 cannot use it.

    Raises CheckpointError on every rank when rank 0 can open it and another rank cannot, or
    sees different metadata: the ranks do not share the directory.
    """
    reader, err = None, None
    try:
        reader = Reader(path)
        problems = attr_problems(reader)
        err = f"checkpoint {path}: {problems[0]}" if problems else None
    except CheckpointError as exc:
        err = str(exc)
    opened = comm.allgather((err, None if reader is None else meta_crc(reader.f)))
    lost = [f"rank {r} cannot open {path}, which rank 0 can ({e})"
            for r, (e, _) in enumerate(opened) if e]
    if len({crc for _, crc in opened}) > 1:
        lost.append(f"the ranks see different files at {path} (their metadata checksums differ)")
    if opened[0][0] is None and not lost:
        return reader, None
    if reader is not None:
        reader.close()
    if opened[0][0] is not None:
        return None, opened[0][0]
    raise CheckpointError(f"{lost[0]}: every rank must see the same checkpoint directory; put "
                          f"--checkpoint-dir on a file system all nodes share")


def _verify(path: str, comm) -> str | None:
    """Why path cannot be resumed from (rank 0's view), or None; collective over comm."""
    reader, why = _open_agreed(path, comm)
    if reader is None:
        return why
    with reader:
        share = (comm.Get_rank(), comm.Get_size())
        mine = [m for i, name in enumerate(reader.names())
                if (m := reader.verify(name, i, share)) is not None]
    bad = [m for per_rank in comm.allgather(mine) for m in per_rank]
    return bad[0] if bad else None


def resolve_resume(resume: str, directory: str, comm=None) -> str | None:
    """The checkpoint to resume from, the same on every rank (collective over comm).

    '' none; 'auto' the newest in directory that verifies (None when there is none yet;
    CheckpointError when there are some and none verifies); else the path given, which every
    rank must see (it is verified while it is loaded). comm: an mpi4py communicator (None:
    this process only).
    """
    if not resume:
        return None
    if comm is None:
        from mpi4py import MPI  # importing it starts MPI: only for callers without a world

        comm = MPI.COMM_SELF
    if resume != "auto":
        _agree_exists(resume, comm)
        return resume
    found = list_checkpoints(directory) if comm.Get_rank() == 0 and directory else []
    candidates = comm.bcast([path for _, path in reversed(found)])
    reasons = []
    for path in candidates:
        why = _verify(path, comm)
        if why is None:
            return path
        reasons.append(why)
        if comm.Get_rank() == 0:
            print(f"hpctrain: warning: --resume auto skips {why}; trying the next older "
                  f"checkpoint", file=sys.stderr, flush=True)
    if reasons:
        raise CheckpointError(
            f"none of the {len(reasons)} checkpoints in {directory} verifies (newest: "
            f"{reasons[0]}); move the damaged files away to start from scratch, or pass "
            f"--resume PATH")
    return None
