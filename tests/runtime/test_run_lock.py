"""The run-directory lock (hpctrain/runtime/run_lock.py): one run at a time per directory.

In-process: the decisions (a live holder, a dead one, the same batch job on another host,
another job there, the override, an unreadable file) on real lock files in tmp_path. Under
mpirun: two zero3 jobs started at once on the same directories; one is refused with one line
and the other's checkpoints and metrics are whole.
"""

import csv
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from hpctrain.runtime import abort
from hpctrain.runtime.run_lock import (LOCK_NAME, UNREADABLE_STALE_S, Holder, RunLockError,
                                       decide, job_of, process_alive, take_dirs)
from tests.mpirun import ROOT, mpi_env

ME = Holder("n01", os.getpid(), "111", "SLURM job 77", time.time(), "me")


def other(**changes) -> Holder:
    """Another run's holder: by default another pid on this host, another job."""
    base = dict(pid=ME.pid + 1, pid_start="222", job="SLURM job 55", since=1795000000.0,
                token="them")
    return dataclasses.replace(ME, **{**base, **changes})


def held_by(d, holder: Holder):
    d.mkdir(exist_ok=True)
    (d / LOCK_NAME).write_bytes(holder.to_bytes())


def alive(*_):
    return True


def dead(*_):
    return False


def test_job_of_names_the_scheduler_and_none_outside_one():
    assert job_of({"SLURM_JOB_ID": "4242", "PBS_JOBID": "9.pbs"}) == "SLURM job 4242"
    assert job_of({"PBS_JOBID": "9.pbs"}) == "PBS job 9.pbs"
    assert job_of({"SLURM_JOB_ID": " "}) is None and job_of({}) is None


def test_a_lock_holds_who_and_since_and_release_removes_only_its_own(tmp_path):
    me = Holder.here({"SLURM_JOB_ID": "4242"})
    lock = take_dirs([("--out-dir", str(tmp_path / "run")), ("--checkpoint-dir",
                      str(tmp_path / "run")), ("--trace", "")], me)
    assert lock.paths == [str(tmp_path / "run" / LOCK_NAME)]  # one directory, one lock
    d = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
    assert (d["host"], d["pid"], d["job"]) == (me.host, os.getpid(), "SLURM job 4242")
    assert abs(d["since"] - time.time()) < 60 and lock.release in abort.BEFORE_ABORT
    held_by(tmp_path / "run", other())  # taken over meanwhile (--force-unlock elsewhere)
    lock.release()
    assert (tmp_path / "run" / LOCK_NAME).exists() and lock.release not in abort.BEFORE_ABORT
    assert os.listdir(tmp_path / "run") == [LOCK_NAME]  # no temporary file left behind


def test_a_live_holder_is_refused_in_one_line_naming_it_and_the_fix(tmp_path):
    held_by(tmp_path / "ck", other())
    with pytest.raises(RunLockError) as info:
        take_dirs([("--out-dir", str(tmp_path / "out")), ("--checkpoint-dir",
                   str(tmp_path / "ck"))], ME, alive=alive)
    msg = str(info.value)
    assert "\n" not in msg
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(other().since))
    assert msg.startswith(f"--checkpoint-dir {tmp_path / 'ck'} is in use by another run (pid "
                          f"{ME.pid + 1} on host n01, SLURM job 55, since {since}; ")
    assert msg.endswith(f"still running); lock file {tmp_path / 'ck' / LOCK_NAME}; give this "
                        f"job its own --checkpoint-dir, or wait for that run to end")
    # out sorts after ck: nothing was taken, and nothing is left
    assert not (tmp_path / "out").exists() and (tmp_path / "ck" / LOCK_NAME).exists()


def test_a_refusal_on_the_second_directory_releases_the_first(tmp_path):
    held_by(tmp_path / "b", other())
    with pytest.raises(RunLockError, match="--checkpoint-dir"):
        take_dirs([("--out-dir", str(tmp_path / "a")), ("--checkpoint-dir",
                   str(tmp_path / "b"))], ME, alive=alive)
    assert os.listdir(tmp_path / "a") == []


@pytest.mark.parametrize("holder, is_alive, taken, said", [
    # same host, its process gone (kill -9): taken over with a warning
    (other(), dead, True, "the run holding it has ended (pid"),
    # this very process (an earlier Trainer never fitted): taken over, nothing said
    (other(pid=ME.pid, pid_start=ME.pid_start), alive, True, ""),
    # another host, the same batch job (a requeued SLURM job): taken over
    (other(host="n02", job="SLURM job 77"), alive, True, "an earlier run of this job"),
    # another host, another job (or none): cannot be checked, refused
    (other(host="n02"), dead, False, "its host cannot be checked from here"),
    (other(host="n02", job=None), dead, False, "no batch job"),
    # the same job on this host, still running (a second srun step): refused
    (other(job="SLURM job 77"), alive, False, "still running"),
])
def test_decisions(holder, is_alive, taken, said):
    got = decide(holder, ME, force=False, age_s=5.0, alive=is_alive)
    assert got.take is taken and said in got.note and (said or not got.note)


def test_another_host_is_refused_unless_forced(tmp_path, capsys):
    held_by(tmp_path / "ck", other(host="n02"))
    flags = [("--checkpoint-dir", str(tmp_path / "ck"))]
    with pytest.raises(RunLockError) as info:
        take_dirs(flags, ME, alive=dead)
    assert str(info.value).endswith("give this job its own --checkpoint-dir, or, if that run "
                                    "has ended, rerun with --force-unlock (or delete the lock "
                                    "file)")
    lock = take_dirs(flags, ME, force=True, alive=dead)
    assert "--force-unlock: taking it over from pid" in capsys.readouterr().out
    assert Holder.parse((tmp_path / "ck" / LOCK_NAME).read_bytes()) == ME
    lock.release()
    assert os.listdir(tmp_path / "ck") == []


def test_stale_lock_is_taken_over_and_said(tmp_path, capsys):
    held_by(tmp_path / "out", other())
    take_dirs([("--out-dir", str(tmp_path / "out"))], ME, alive=dead).release()
    assert capsys.readouterr().out.startswith(
        f"hpctrain: warning: --out-dir {tmp_path / 'out'}: the run holding it has ended (pid ")


def test_an_unreadable_lock_is_being_made_when_young_and_stale_when_old(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"")
    flags = [("--out-dir", str(tmp_path))]
    with pytest.raises(RunLockError, match="creating its lock right now"):
        take_dirs(flags, ME)
    old = time.time() - UNREADABLE_STALE_S - 5
    os.utime(tmp_path / LOCK_NAME, (old, old))
    take_dirs(flags, ME, say=lambda line: None).release()
    assert os.listdir(tmp_path) == []


def ended_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def test_process_alive_sees_an_ended_process_and_a_reused_pid():
    assert not process_alive(ended_pid(), None)
    me = Holder.here({})
    assert process_alive(me.pid, me.pid_start)
    assert not process_alive(me.pid, "1")  # the same pid, started at another time


def test_force_unlock_reaches_the_lock_from_the_cli_and_the_api(monkeypatch, capsys):
    """--force-unlock and Trainer(force_unlock=True) get to the TrainingRun that takes the lock;
    a refusal from it is the CLI's one line and exit 2 (no MPI here: the engine is faked)."""
    import hpctrain
    import hpctrain.runtime.world as world
    import hpctrain.train.training_run as engine
    from hpctrain import cli

    given = []

    class Engine:
        def __init__(self, *args, force_unlock=False, **kwargs):
            given.append(force_unlock)
            raise RunLockError("--out-dir o is in use by another run (...)")

    monkeypatch.setattr(engine, "TrainingRun", Engine)
    monkeypatch.setattr(world, "init_world", lambda *a, **k: None)
    for flags in ([], ["--force-unlock"]):
        rc = cli.main(["train", "--model", "mlp", "--steps", "1", "--out-dir", "", *flags])
        assert rc == 2 and capsys.readouterr().err == (
            "hpctrain: error: --out-dir o is in use by another run (...)\n")
    with pytest.raises(RunLockError):
        hpctrain.Trainer(steps=1, out_dir="", force_unlock=True).setup()
    assert given == [False, True, True]


@pytest.mark.mpi
def test_two_jobs_started_at_once_on_the_same_directories(tmp_path):
    """Two zero3 launches (2 ranks each, other seeds) on one --out-dir/--checkpoint-dir that
    a killed run left locked: one takes the lock over (a warning), the other exits 2 with one
    line naming it; the first, held after its second step until then, finishes with all its
    checkpoints and metrics rows."""
    hold = tmp_path / "hold"
    hold.write_text("")
    held_by(tmp_path / "run", dataclasses.replace(Holder.here({}), pid=ended_pid(),
                                                  pid_start=None, token="killed"))
    env = mpi_env({"SLOW_STEP_S": "0", "SLOW_HOLD": f"3:{hold}"})
    procs = {}
    for seed in (1, 2):
        args = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                "-m", "hpctrain", "train", "--strategy", "zero3", "--model",
                "tests.fixtures.slow:factory", "--steps", "6", "--seed", str(seed),
                "--progress", "off", "--out-dir", str(tmp_path / "run"), "--checkpoint-dir",
                str(tmp_path / "run"), "--checkpoint-every", "2", "--set", "train.report=false",
                "--set", "train.tensorboard=false"]
        procs[seed] = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        refused = next(s for s, p in procs.items() if p.poll() is not None)
        out, err = procs[refused].communicate(timeout=30)
        hold.unlink()  # the holder goes on
        kept = 3 - refused
        kept_out, kept_err = procs[kept].communicate(timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[refused].returncode == 2, out + err
    lines = [line for line in err.splitlines() if "hpctrain: error:" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hpctrain: error: --out-dir and --checkpoint-dir "
                               f"{tmp_path / 'run'} is in use by another run (pid "), err
    assert "still running); lock file" in lines[0] and "Traceback" not in err
    assert procs[kept].returncode == 0, kept_out + kept_err
    assert f"hpctrain: warning: --out-dir and --checkpoint-dir {tmp_path / 'run'}: the run " \
           f"holding it has ended" in kept_out, kept_out
    import h5py

    run = tmp_path / "run"
    names = sorted(n for n in os.listdir(run) if n.startswith("ckpt-"))
    assert names == ["ckpt-000002.h5", "ckpt-000004.h5", "ckpt-000006.h5"], os.listdir(run)
    for name in names:
        with h5py.File(run / name, "r") as f:
            assert f"seed = {kept}" in f.attrs["config_toml"]
    with open(run / "metrics.csv", newline="") as fh:
        assert [r["step"] for r in csv.DictReader(fh)] == [str(s) for s in range(1, 7)]
    assert not (run / LOCK_NAME).exists()


def test_an_abort_runs_every_hook_when_the_lock_unregisters_itself(tmp_path, monkeypatch):
    # The lock's release leaves BEFORE_ABORT while the abort walks it: the watchdog's hook
    # after it must still run (it once was skipped, leaving the stall channel behind).
    lock = take_dirs([("--out-dir", str(tmp_path / "run"))], Holder.here({}))
    ran = []
    monkeypatch.setattr(abort, "BEFORE_ABORT", [lock.release, lambda: ran.append("next")])
    monkeypatch.setattr(abort, "_mpi", lambda: None)
    monkeypatch.setattr(os, "_exit", lambda code: ran.append(code))
    abort._abort(7)
    assert ran == ["next", 7] and not (tmp_path / "run" / LOCK_NAME).exists()
