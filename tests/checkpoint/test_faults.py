"""Checkpoint faults that lost data or hung: full disk, shared directories, lagging listings,
a damaged newest checkpoint, saving a step again in serial mode (fault_worker runs the cases)."""

import contextlib
import os
import re
import subprocess

import pytest

from hpctrain.checkpoint import manager
from hpctrain.checkpoint.writer import FAULT_ENV
from tests.mpirun import run_mpi, run_single

WORKER = ["-W", "ignore::RuntimeWarning", "-m", "tests.checkpoint.fault_worker"]


@contextlib.contextmanager
def _tmpfs(path, size):
    """Mount a tmpfs of size at path; yield path, or None where it cannot be mounted."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True)
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        # Lazy: the ranks' launcher may hold it a moment longer; it goes once they let go.
        subprocess.run(["umount", "-l", str(path)], check=True)


def _no_tmpfs():
    pytest.skip("cannot mount a small tmpfs here (needs root)")


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """{n: (dir, proc, small)}: every fault_worker case at n = 2 and 4 ranks. The 2-rank
    launch also fills a real small file system (SMALL_FS: a 300k tmpfs, small None where
    none can be mounted) in its real_full_disk case, which is a no-op without one."""
    runs = {}
    for n in (2, 4):
        tmp = tmp_path_factory.mktemp(f"faults{n}")
        with _tmpfs(tmp_path_factory.mktemp("small") / "fs", "300k") if n == 2 else \
                contextlib.nullcontext() as small:
            env = {"SMALL_FS": str(small)} if small else None
            proc = run_mpi(n, WORKER + [str(tmp)], check=False, timeout=300, env=env)
        runs[n] = (tmp, proc, small)
    return runs


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_fault_cases(fault_runs, n):
    tmp_path, proc, _ = fault_runs[n]
    out = proc.stdout + proc.stderr
    names = re.search(r"^cases: (.*)$", proc.stdout, re.M).group(1).split(",")
    assert len(names) >= 12, names
    for name in names:
        for r in range(n):
            assert f"rank {r}: {name} ok" in out, out
    assert proc.returncode == 0, out
    # Which file was skipped, and why, is said once (by rank 0).
    skipped = f"--resume auto skips checkpoint {tmp_path}/auto_skips_corrupt_newest/ckpt-000020.h5"
    assert proc.stderr.count(skipped + ": dataset 'rep/b' fails its checksum") == 1, proc.stderr
    assert "metadata checksum mismatch" in proc.stderr


@pytest.mark.mpi
def test_real_full_disk(fault_runs):
    _, proc, small = fault_runs[2]  # its real_full_disk case ran on the small tmpfs
    if small is None:
        _no_tmpfs()
    out = proc.stdout + proc.stderr
    assert "rank 0: real_full_disk ok" in out and "rank 1: real_full_disk ok" in out, out
    assert proc.returncode == 0, out  # no crash at exit after the failed saves


def test_disk_filling_during_a_save_exits_1_with_one_line(tmp_path):
    """The CLI at one rank (HDF5's MPI-IO driver still): the disk fills as the save writes
    (another writer takes the rest once the first dataset is written). Exit 1, the one line
    last, the partial file gone; it used to segfault at exit (139) after the line."""
    with _tmpfs(tmp_path / "ck", "2m") as ck:
        if ck is None:
            _no_tmpfs()
        proc = run_single(["-m", "hpctrain", "train", "--steps", "1", "--checkpoint-every",
                           "1", "--checkpoint-dir", str(ck), "--out-dir", str(tmp_path / "out"),
                           "--progress", "off"], check=False, timeout=60,
                          env={FAULT_ENV: "0:1:fill"})
        left = sorted(os.listdir(ck))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert last.startswith(f"hpctrain: error: checkpoint write to {ck}/ckpt-000001.h5 failed: "
                           "no space left on device (needed ~"), proc.stderr
    assert proc.stderr.count("hpctrain: error:") == 1, proc.stderr
    assert left == [".filler"], left


def test_prune_tolerates_files_another_job_removed(tmp_path, monkeypatch):
    for step in (1, 2, 3, 4):
        (tmp_path / f"ckpt-{step:06d}.h5").write_bytes(b"x")
    listed = manager.list_checkpoints(str(tmp_path))
    (tmp_path / "ckpt-000001.h5").unlink()  # the other job pruned it after our listing
    monkeypatch.setattr(manager, "list_checkpoints", lambda d: listed)
    assert manager.prune(str(tmp_path), 2) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000003.h5", "ckpt-000004.h5"]


def test_prune_reports_instead_of_raising(tmp_path, monkeypatch):
    for step in (1, 2):
        (tmp_path / f"ckpt-{step:06d}.h5").write_bytes(b"x")

    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(manager.os, "remove", refuse)
    problems = manager.prune(str(tmp_path), 1)
    assert problems == [f"{tmp_path}/ckpt-000001.h5: Permission denied"]


def test_latest_pointer_names_are_per_process(tmp_path):
    manager.write_latest_pointer(str(tmp_path), str(tmp_path / "ckpt-000002.h5"))
    assert os.listdir(tmp_path) == ["latest"]
    assert (tmp_path / "latest").read_text() == "ckpt-000002.h5\n"
