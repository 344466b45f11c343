"""mpirun worker for test_faults: checkpoint faults that lose data or hang, many cases per launch.

    python -m tests.checkpoint.fault_worker DIR [CASE ...]
Each case runs collectively in its own subdirectory of DIR and prints "rank R: CASE ok", or
"rank R: CASE FAIL: why". A case that hangs hangs the launch (the test's timeout names it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import traceback

import h5py
import numpy as np
import torch
from mpi4py import MPI

from hpctrain.checkpoint import commit, manager, resume
from hpctrain.checkpoint.layout import Entry, from_numpy
from hpctrain.checkpoint.meta import JSON_ATTRS
from hpctrain.checkpoint.reader import CheckpointError, Reader
from hpctrain.checkpoint.serial_fallback import FORCE_ENV, parts_dir
from hpctrain.checkpoint.state import FORMAT, write_entries
from hpctrain.checkpoint.writer import FAULT_ENV
from tests.checkpoint.elem_worker import FLAT, REP, ROWS, entries, tensor

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.Get_rank(), COMM.Get_size()
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def check(cond, what):
    if not cond:
        raise AssertionError(what)


@contextlib.contextmanager
def env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def run_attrs(step: int) -> dict:
    """The root attributes of a training checkpoint, for files that resolve_resume vets."""
    meta = {"sampler_state": {"step": step}, "grad_scaler": {}, "model_aliases": {},
            "optim_class": "SGD", "optim_param_groups": [{"lr": 0.1, "params": []}]}
    return {"format": FORMAT, "step": np.int64(step), "world_size": np.int64(WORLD),
            "strategy": "ddp", "config_toml": "", JSON_ATTRS: json.dumps(sorted(meta)),
            **{k: json.dumps(v) for k, v in meta.items()}}


def save(d: str, step: int, scale: float = 1.0) -> str:
    """Write a synthetic checkpoint d/ckpt-STEP.h5 (collective); scale changes its content."""
    path = manager.checkpoint_path(d, step)
    es = entries(RANK, WORLD, False)
    for e in es:
        if e.local is not None and e.local.is_floating_point():
            e.local = e.local * scale
    rng = torch.zeros((WORLD, torch.get_rng_state().numel()), dtype=torch.uint8)
    es += [Entry("rng/torch_cpu", tuple(rng.shape), rng.dtype, rng),
           Entry("train/losses", (step,), torch.float64, torch.ones(step, dtype=torch.float64))]
    write_entries(path, es, run_attrs(step), COMM)
    return path


def expect_error(fn, *words) -> str:
    """Run fn; it must raise CheckpointError containing words (on this rank)."""
    try:
        fn()
    except CheckpointError as exc:
        for w in words:
            check(w in str(exc), f"{w!r} not in {exc}")
        return str(exc)
    raise AssertionError(f"no CheckpointError (expected one with {words})")


def corrupt(path: str, name: str = REP[0]) -> None:
    """Rank 0 changes one value of dataset name behind the checksum's back."""
    if RANK == 0:
        with h5py.File(path, "r+") as f:
            f[name][0, 0] = f[name][0, 0] + 1.0
    COMM.Barrier()


def read_all(path: str, scale: float = 1.0) -> None:
    """Every tensor of a synthetic checkpoint reads back whole, verified, equal to its content."""
    with Reader(path) as r:
        for name, shape, dtype in FLAT + [ROWS, REP]:
            got = r.read(name, shape)
            want = tensor(name, shape, dtype)
            if want.is_floating_point():
                want = want * scale
            check(got is None or torch.equal(from_numpy(got, dtype), want), name)
        r.check(COMM)


def listing(d: str) -> list[str]:
    return sorted(os.listdir(d))


# -- 23.5: a full disk fails the save on every rank, nothing partial is left ------------------

def _disk_full(d: str, fault: str, serial: str) -> None:
    with env(**{FORCE_ENV: serial}):
        good = save(d, 1)
        with env(**{FAULT_ENV: fault}):
            msg = expect_error(lambda: save(d, 2), "checkpoint write to", "ckpt-000002.h5",
                               "no space left on device (needed ~")
        check(COMM.allgather(msg) == [msg] * WORLD, "ranks raised different errors")
        COMM.Barrier()
        parts = ["ckpt-000001.h5.parts"] if serial == "1" else []
        check(listing(d) == ["ckpt-000001.h5"] + parts, listing(d))
        read_all(good)
        # the previous checkpoint is intact and is what --resume auto picks
        picked = resume.resolve_resume("auto", d, COMM)
        check(picked is not None and os.path.samefile(picked, good), (picked, good))


@case
def disk_full_on_rank1_parallel(d):
    _disk_full(d, "1:2:enospc", "0")


@case
def disk_full_on_rank0_parallel(d):
    _disk_full(d, "0:1:enospc", "0")


@case
def disk_full_on_last_rank_serial(d):
    _disk_full(d, f"{WORLD - 1}:3:enospc", "1")


@case
def real_full_disk(d):
    """On a real small file system (SMALL_FS, a tmpfs the test mounted): refused up front,
    and, past that check, failing in the middle of the write."""
    small = os.environ.get("SMALL_FS")
    if not small:
        return
    d = os.path.join(small, "ck")
    if RANK == 0:
        os.makedirs(d)
    COMM.Barrier()
    big = [Entry(f"model/w{i}", (40000,), torch.float32, torch.ones(40000)) for i in range(4)]
    final = manager.checkpoint_path(d, 1)
    for serial in ("0", "1"):
        with env(**{FORCE_ENV: serial}):
            expect_error(lambda: write_entries(final, big, {}, COMM),
                         "no space left on device (needed ~0.7 MB")
            real, commit._check_space = commit._check_space, lambda final, needed: None
            try:
                expect_error(lambda: write_entries(final, big, {}, COMM),
                             "no space left on device (needed ~0.7 MB")
            finally:
                commit._check_space = real
        COMM.Barrier()
        check(listing(d) == [], listing(d))
        COMM.Barrier()  # every rank looked before the next save makes a new tmp
    # The disk fills in the middle of the save (another writer, as rank 0 wrote its first
    # dataset): every rank fails the save with the one reason, nothing is left, and the
    # process stays sound (HDF5 once crashed at exit after such a save: the test checks the
    # launch's exit code) and saves again once there is room.
    small_entries = [Entry(f"model/w{i}", (10000,), torch.float32, torch.ones(10000))
                     for i in range(4)]
    for serial in ("0", "1"):
        with env(**{FORCE_ENV: serial, FAULT_ENV: "0:1:fill"}):
            expect_error(lambda: write_entries(final, small_entries, {}, COMM),
                         "no space left on device (needed ~0.2 MB")
        COMM.Barrier()
        fillers = [p for p in (os.path.join(d, ".filler"),) if os.path.exists(p)]
        check(len(fillers) == (serial == "0"), listing(d))  # a serial save's is in its parts
        check([n for n in listing(d) if n != ".filler"] == [], listing(d))
        COMM.Barrier()
        if RANK == 0:
            for p in fillers:
                os.remove(p)
        COMM.Barrier()
    write_entries(final, small_entries, {}, COMM)
    with Reader(final) as r:
        check(np.array_equal(r.read("model/w3", (10000,)), np.ones(10000, np.float32)), "w3")


# -- 23.6: saving a step again in serial mode keeps the complete one until the new one is -----

@case
def serial_resave_failure_keeps_complete(d):
    with env(**{FORCE_ENV: "1"}):
        path = save(d, 5)
        with env(**{FAULT_ENV: "1:4:enospc" if WORLD > 1 else "0:4:enospc"}):
            expect_error(lambda: save(d, 5, scale=2.0), "no space left")
        read_all(path)  # the complete checkpoint of step 5 is intact
        save(d, 5, scale=3.0)
        read_all(path, scale=3.0)
        check(len(os.listdir(parts_dir(path))) == 1, os.listdir(parts_dir(path)))


# -- a live save's temporary file is never taken or cleaned; a dead one's is ----------------

@case
def claim_held_by_live_save(d):
    final = manager.checkpoint_path(d, 3)
    tmp = manager.tmp_path(final)
    holder = None
    if RANK == 0:
        import fcntl

        holder = os.open(tmp, os.O_RDWR | os.O_CREAT)
        fcntl.flock(holder, fcntl.LOCK_EX)  # as another job's rank 0 in the middle of a save
    COMM.Barrier()
    commit.CLAIM_WAIT_S = 0.3
    expect_error(lambda: save(d, 3), "being written by another save")
    check(commit.clean_stale(d, COMM) == [] and os.path.exists(tmp), "a live save's tmp removed")
    if RANK == 0:
        os.close(holder)  # that save died
    COMM.Barrier()
    removed, left = commit.clean_stale(d, COMM), listing(d)
    COMM.Barrier()  # everyone looked before the save below makes a new tmp
    check(removed == [tmp] and left == [], left)
    save(d, 3)
    read_all(final)


# -- 16.8 + 23.3: --resume auto is chosen once, skipping damaged files, agreed by all ----------

def _two(d: str) -> tuple[str, str]:
    return save(d, 10), save(d, 20)


@case
def auto_skips_corrupt_newest(d):
    old, new = _two(d)
    corrupt(new)
    got = resume.resolve_resume("auto", d, COMM)
    check(got == old, got)


@case
def auto_skips_changed_metadata(d):
    old, new = _two(d)
    if RANK == 0:
        with h5py.File(new, "r+") as f:
            f.attrs["step"] = np.int64(16)  # data intact, step wrong
    COMM.Barrier()
    check(resume.resolve_resume("auto", d, COMM) == old, "changed step not skipped")


@case
def auto_none_verifies(d):
    old, new = _two(d)
    corrupt(old)
    corrupt(new)
    expect_error(lambda: resume.resolve_resume("auto", d, COMM), "none of the 2 checkpoints",
                 "fails its checksum")


@case
def auto_empty_dir_starts_fresh(d):
    check(resume.resolve_resume("auto", d, COMM) is None, "empty dir")


@case
def auto_lagging_listing_agrees(d):
    old, new = _two(d)
    real = os.listdir
    if RANK == 1:  # this rank's view of the directory lags: it does not list the newest yet
        os.listdir = lambda p=".": [n for n in real(p) if n != os.path.basename(new)]
    try:
        got = resume.resolve_resume("auto", d, COMM)
    finally:
        os.listdir = real
    check(got == new, f"rank {RANK} chose {got}")


@case
def auto_rank_cannot_open(d):
    _, new = _two(d)
    real = resume.Reader
    if RANK == WORLD - 1:  # node-local directory: this rank has no such file
        def missing(path):
            raise CheckpointError(f"cannot open checkpoint {path!r}: No such file or directory")
        resume.Reader = missing
    try:
        expect_error(lambda: resume.resolve_resume("auto", d, COMM),
                     f"rank {WORLD - 1} cannot open {new}",
                     "every rank must see the same checkpoint directory")
    finally:
        resume.Reader = real


@case
def explicit_missing_on_one_rank(d):
    path = save(d, 10)
    real = os.path.isfile
    if RANK == WORLD - 1:
        os.path.isfile = lambda p: False if p == path else real(p)
    try:
        expect_error(lambda: resume.resolve_resume(path, d, COMM), f"rank {WORLD - 1}:",
                     "does not exist")
    finally:
        os.path.isfile = real


# -- --resume auto picks by the step in the verified metadata, not by the file name ---------

def _auto_says(d: str) -> tuple[str, str]:
    """(the path --resume auto picks, the line rank 0 printed about it)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        got = resume.resolve_resume("auto", d, COMM)
    said = [ln for ln in out.getvalue().splitlines() if "--resume auto picked" in ln]
    check(len(said) == (1 if RANK == 0 and got else 0), f"rank {RANK} said {said}")
    return got, COMM.bcast(said[0] if said else "")


def _move(src: str, dst: str, mtime: float | None = None) -> None:
    """Rank 0 renames (or, with mtime, copies and dates) a checkpoint, as a user might."""
    if RANK == 0:
        if mtime is None:
            os.rename(src, dst)
        else:
            shutil.copyfile(src, dst)
            os.utime(dst, (mtime, mtime))
    COMM.Barrier()


@case
def auto_renamed_old_file_loses(d):
    old, new = _two(d)
    renamed = manager.checkpoint_path(d, 99)
    _move(old, renamed)  # step 10 under the name of step 99
    got, said = _auto_says(d)
    check(got == new, f"picked {got}, not the step-20 file")
    check(said == f"hpctrain: --resume auto picked {new}: step 20, the highest step in {d} "
                  f"that verifies", said)


@case
def auto_tie_newest_write_wins(d):
    _, new = _two(d)
    copy = manager.checkpoint_path(d, 30)  # step 20 again, under another name
    _move(new, copy, mtime=os.stat(new).st_mtime - 100)
    got, said = _auto_says(d)
    check(got == new, f"picked {got}: the older write of step 20")
    check(said.endswith(f"picked {new}: step 20, the highest step in {d} that verifies; of "
                        f"the 2 files at that step, the last written"), said)
    if RANK == 0:
        os.utime(copy, (os.stat(new).st_mtime + 100,) * 2)
    COMM.Barrier()
    got, said = _auto_says(d)
    check(got == copy, f"picked {got}: the older write of step 20")
    check(said.endswith("the last written; its name says step 30"), said)


@case
def auto_skips_unreadable_by_step(d):
    old, new = _two(d)
    if RANK == 0:  # not HDF5, and an HDF5 file cut short: both named above step 20
        with open(manager.checkpoint_path(d, 40), "wb") as f:
            f.write(b"not a checkpoint")
        with open(new, "rb") as f:
            head = f.read(4096)
        with open(manager.checkpoint_path(d, 30), "wb") as f:
            f.write(head)
    COMM.Barrier()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        got, said = _auto_says(d)
    check(got == new and said.endswith(f"picked {new}: step 20, the highest step in {d} that "
                                       f"verifies"), (got, said))
    warned = [ln for ln in err.getvalue().splitlines() if "--resume auto skips" in ln]
    want = 2 if RANK == 0 else 0
    check(len(warned) == want and all("ckpt-000030.h5" in w or "ckpt-000040.h5" in w
                                      for w in warned), warned)


def main() -> int:
    base = sys.argv[1]
    failed = 0
    if RANK == 0:
        print(f"cases: {','.join(sys.argv[2:] or CASES)}", flush=True)
    only = sys.argv[2:]  # case names (default: all)
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        d = os.path.join(base, name)
        if RANK == 0:
            os.makedirs(d)
        COMM.Barrier()
        try:
            fn(d)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - report and go on to the next case
            status = f"FAIL: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            failed += 1
        print(f"rank {RANK}: {name} {status}", flush=True)
        COMM.Barrier()
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
