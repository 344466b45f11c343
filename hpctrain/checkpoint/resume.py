"""Choose the checkpoint to resume from once, on rank 0, and make every rank agree on it.

Each rank listing the directory itself goes wrong: with a lagging shared file system (or
node-local directories) ranks picked different steps and the job hung; and a corrupt newest
checkpoint stopped every requeued restart. Here rank 0 lists them, highest step first (the
step in each file's verified metadata, not its name); all ranks verify each candidate
together (every rank opens it, each checks its share of the checksums) and a damaged one
is skipped with the reason. A rank that cannot open the file rank 0 can open
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


def _ranked(directory: str) -> tuple[list[tuple[int, str]], list[str]]:
    """((step, path) of the checkpoints in directory, highest step first; why each other
    one cannot be used), read on this process.

    The order is by the step in each file's verified metadata, not by its name (a renamed
    or copied file names a step it does not hold); among files of the same step the newest
    write (modification time) comes first, then the higher name.
    """
    found, skipped = [], []
    for _, path in list_checkpoints(directory):
        try:
            with Reader(path) as reader:
                problems = attr_problems(reader)
                step = None if problems else int(reader.attrs["step"])
            mtime = os.stat(path).st_mtime_ns
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - rank 0 alone: the others wait in the bcast
            skipped.append(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc})")
            continue
        if problems:
            skipped.append(f"checkpoint {path}: {problems[0]}")
        else:
            found.append((step, mtime, path))
    return [(step, path) for step, _, path in sorted(found, reverse=True)], skipped


def _skip(comm, why: str) -> None:
    if comm.Get_rank() == 0:
        print(f"hpctrain: warning: --resume auto skips {why}; trying the next older "
              f"checkpoint", file=sys.stderr, flush=True)


def _picked(path: str, step: int, candidates: list, directory: str, comm) -> None:
    """Rank 0 says which file --resume auto took, its step, and why that one."""
    if comm.Get_rank() != 0:
        return
    same = sum(s == step for s, _ in candidates)
    tie = f"; of the {same} files at that step, the last written" if same > 1 else ""
    named = int(os.path.basename(path)[len("ckpt-"):-len(".h5")])
    name = "" if named == step else f"; its name says step {named}"
    print(f"hpctrain: --resume auto picked {path}: step {step}, the highest step in "
          f"{directory} that verifies{tie}{name}", flush=True)


def resolve_resume(resume: str, directory: str, comm=None) -> str | None:
    """The checkpoint to resume from, the same on every rank (collective over comm).

    '' none; 'auto' the checkpoint in directory with the highest step recorded in its
    metadata that verifies (see _ranked; None when there is none yet; CheckpointError when
    there are some and none verifies); else the path given, which every rank must see (it
    is verified while it is loaded). comm: an mpi4py communicator (None: this process only).
    """
    if not resume:
        return None
    if comm is None:
        from mpi4py import MPI  # importing it starts MPI: only for callers without a world

        comm = MPI.COMM_SELF
    if resume != "auto":
        _agree_exists(resume, comm)
        return resume
    ranked = _ranked(directory) if comm.Get_rank() == 0 and directory else ([], [])
    candidates, reasons = comm.bcast(ranked)
    for why in reasons:
        _skip(comm, why)
    for step, path in candidates:
        why = _verify(path, comm)
        if why is None:
            _picked(path, step, candidates, directory, comm)
            return path
        reasons.append(why)
        _skip(comm, why)
    if reasons:
        raise CheckpointError(
            f"none of the {len(reasons)} checkpoints in {directory} verifies (first: "
            f"{reasons[0]}); move the damaged files away to start from scratch, or pass "
            f"--resume PATH")
    return None
