"""Pre-emption: the signal flag, the all-rank agreement, requeue, exit code 75.

The mpirun jobs run side by side (tests/hpc/side_by_side.py): they mostly wait on paced steps
and on mpirun's kill timeouts; each test checks its own job.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hpctrain.train.preemption import (PREEMPT_EXIT_CODE, Preempted, Preemption,
                                       requeue_command)
from tests.hpc.procs import session_procs
from tests.hpc.side_by_side import SideBySide, selected
from tests.mpirun import mpi_env


class OneRank:
    """A 1-rank communicator: max over one rank is the value itself."""

    rank, size = 0, 1

    def __init__(self):
        self.calls = 0
        self.barriers = 0

    def barrier(self):
        self.barriers += 1

    def allreduce_scalars(self, values, op="sum"):
        assert op == "max"
        self.calls += 1
        return list(values)


def test_signal_sets_flag_and_restore_puts_handler_back():
    before, out = signal.getsignal(signal.SIGUSR1), sys.stdout
    comm = OneRank()
    with Preemption(requeue="off") as p:
        assert not p.should_stop(comm)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.received == signal.SIGUSR1
        assert p.should_stop(comm)
    assert signal.getsignal(signal.SIGUSR1) is before and sys.stdout is out
    assert comm.calls == 2  # one collective per step boundary


def test_second_sigterm_kills():
    # Already stopping on SIGTERM, a second SIGTERM takes the default action (a hung job dies).
    code = ("import os, signal, time\n"
            "from hpctrain.train.preemption import Preemption\n"
            "p = Preemption().install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('survived first', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(5)\nprint('survived second')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=mpi_env())
    assert "survived first" in proc.stdout and "survived second" not in proc.stdout
    assert proc.returncode == -signal.SIGTERM


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_sigterm_unblocks_a_print_nobody_reads(tmp_path, unbuffered):
    """mpirun, asleep before it forwards SIGTERM, reads no output: a rank blocks in a print
    on its full pipe. SIGTERM must still bring it to its stop step: what does not fit is
    dropped (one line on stderr says so) and the closing line goes to stderr; with Python's
    stdout buffered or not (PYTHONUNBUFFERED, which the MPI tests set)."""
    code = ("import signal, sys, threading\n"
            "from hpctrain.train.preemption import Preemption, Preempted\n"
            "class Comm:\n    rank = 0\n    def barrier(self): pass\n"
            "p = Preemption(requeue='off', env={}, grace_s=30).install()\n"
            "threading.Timer(0.5, signal.pthread_kill,\n"
            "                (threading.main_thread().ident, signal.SIGTERM)).start()\n"
            "while p.received is None:\n    print('x' * 99, flush=True)\n"
            "try:\n    p.finish(7, 'ck/ckpt-000007.h5', Comm())\n"
            "except Preempted:\n    p.restore()\n    sys.exit(75)\n")
    unread, stdout = os.pipe()  # held open, never read: a launcher that stopped reading
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=err,
                                env=mpi_env({"PYTHONUNBUFFERED": unbuffered}))
    os.close(stdout)
    try:
        rc = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(unread)
    err = (tmp_path / "err").read_text()
    assert rc == PREEMPT_EXIT_CODE, err
    assert "after SIGTERM nobody reads this rank's stdout" in err, err
    assert "SIGTERM received; stopped after step 7, checkpoint ck/ckpt-000007.h5" in err, err


def test_requeue_command():
    assert requeue_command({"SLURM_JOB_ID": "123"}) == ["scontrol", "requeue", "123"]
    assert requeue_command({"PBS_JOBID": "9.srv"}) is None


def _fake_scontrol(tmp_path, rc):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f"#!/bin/sh\necho \"$@\" > {tmp_path}/scontrol.args\n"
        f"[ {rc} = 0 ] || echo 'Requested operation is presently disabled' >&2\nexit {rc}\n")
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("rc", [0, 1])
def test_finish_requeues_under_slurm(tmp_path, monkeypatch, capsys, rc):
    monkeypatch.setenv("PATH", f"{_fake_scontrol(tmp_path, rc)}{os.pathsep}{os.environ['PATH']}")
    p = Preemption(env={"SLURM_JOB_ID": "77"})
    p.received = signal.SIGUSR1
    with pytest.raises(Preempted) as info:
        p.finish(12, "ck/ckpt-000012.h5", OneRank())
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "77"]
    assert info.value.requeued is (rc == 0) and info.value.step == 12
    out = capsys.readouterr()
    assert "SIGUSR1 received; stopped after step 12" in out.out
    if rc:
        assert "submit the job with --requeue" in out.err


def test_finish_without_slurm_or_with_requeue_off(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_scontrol(tmp_path, 0)}{os.pathsep}{os.environ['PATH']}")
    for p in (Preemption(env={}), Preemption(requeue="off", env={"SLURM_JOB_ID": "5"})):
        p.received = signal.SIGTERM
        with pytest.raises(Preempted) as info:
            p.finish(3, "x.h5", OneRank())
        assert not info.value.requeued and "rerun with --resume auto" in str(info.value)
    assert not (tmp_path / "scontrol.args").exists()


def one_signalled_rank_stops_all_at_the_same_step(reference, tmp_path):
    """Only rank 1 gets SIGUSR1: both ranks stop after the same step, checkpoint, exit 75."""
    args = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "hpctrain", "train", "--strategy",
            "ddp", "--model", "tests.fixtures.slow:factory", "--steps", "20", "--progress", "off",
            "--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto", "--summary",
            str(tmp_path / "s.json"), "--out-dir", str(tmp_path / "out"), "--requeue", "off"]
    env = mpi_env({"SLOW_STEP_S": "0.2"})
    proc = subprocess.Popen(args, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "out" / "metrics.csv"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        rank1 = _rank_pid(proc.pid, "1")
        os.kill(rank1, signal.SIGUSR1)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == PREEMPT_EXIT_CODE, out
    m = re.search(r"SIGUSR1 received; stopped after step (\d+)", out)
    assert m, out
    stopped = int(m.group(1))
    assert 3 <= stopped < 20
    assert sorted(os.listdir(tmp_path / "ck")) == ["ckpt-%06d.h5" % stopped, "latest"]
    # the rerun needs no pacing: nothing signals it
    again = subprocess.run(args, env=dict(env, SLOW_STEP_S="0"), cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"at step {stopped}" in again.stdout
    got = json.loads((tmp_path / "s.json").read_text())
    # 2 ranks against the 4-rank reference: DDP's rank-count tolerance.
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5, atol=0)


def _rank_pid(session_id, rank):
    """PID of the hpctrain rank `rank` among the processes of session `session_id`."""
    for pid, data in session_procs(session_id, "environ"):
        environ = dict(kv.split(b"=", 1) for kv in data.split(b"\0") if b"=" in kv)
        if environ.get(b"OMPI_COMM_WORLD_RANK") == rank.encode():
            return pid
    raise AssertionError(f"no rank {rank} in session {session_id}")


def test_sigterm_grace_per_launcher():
    from hpctrain.train.preemption import sigterm_grace_s

    assert sigterm_grace_s("openmpi", {}) == 1.0
    assert sigterm_grace_s("openmpi", {"OMPI_MCA_odls_base_sigkill_timeout": "60"}) == 60.0
    assert sigterm_grace_s("slurm", {}) == 30.0 and sigterm_grace_s("pals", {}) == 10.0
    assert sigterm_grace_s("single", {}) is None
    assert sigterm_grace_s("openmpi", {}, configured=45) == 45


def test_a_save_that_cannot_finish_before_sigkill_is_not_started(capsys):
    """_stop_on_signal with 0.5 s left and a 3 s save: no save, Preempted(saved=False)."""
    from types import SimpleNamespace

    from hpctrain.config import Config
    from hpctrain.train.training_run import TrainingRun

    saves = []
    t = TrainingRun.__new__(TrainingRun)
    t.cfg = Config()
    t.cfg.checkpoint.dir = "/nonexistent-ckpt-dir"
    t.world = SimpleNamespace(host=OneRankSum(), is_main=True, size=1)
    t._save_s = 2.0  # the last save took 2 s: ~3.5 s needed
    t.save = lambda step, losses: saves.append(step)
    p = Preemption(requeue="off", grace_s=10.0)
    p.received, p.term_at = signal.SIGTERM, time.monotonic() - 9.5
    with pytest.raises(Preempted) as info:
        t._stop_on_signal(7, 5, [1.0] * 7, p)
    assert saves == [] and info.value.saved is False and info.value.step == 7
    assert "not starting it" in capsys.readouterr().out
    p.term_at = time.monotonic()  # 10 s left: the save fits
    t.save = lambda step, losses: saves.append(step) or f"ck/ckpt-{step}.h5"
    with pytest.raises(Preempted) as info:
        t._stop_on_signal(7, 5, [1.0] * 7, p)
    assert saves == [7] and info.value.saved and info.value.path == "ck/ckpt-7.h5"


class OneRankSum(OneRank):
    def allreduce_scalars(self, values, op="sum"):
        self.calls += 1
        return list(values)


class _OneRankComm:
    def Get_rank(self):
        return 0

    def bcast(self, obj, root=0):
        return obj


def _run_until_steps(args, env, tmp_path, steps):
    proc = subprocess.Popen(args, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "out" / "metrics.csv"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) > steps:
            break
        time.sleep(0.1)
    return proc


def sigterm_to_mpirun_never_loses_a_checkpoint(tmp_path, sigkill_after):
    """mpirun, on SIGTERM, sends the ranks SIGCONT, waits odls_base_sigkill_timeout (1 s by
    default), sends SIGTERM, waits as long again, then SIGKILL, reading none of their output
    while it waits. With 1 s the ranks exit 75 at once (no save started, the old checkpoints
    intact). Given 5 s, with --log-every 1 and a model that prints 2 KB a step, the ranks fill
    their unread ptys and block in a print long before their SIGTERM; they must still
    checkpoint the step they stopped at, before SIGKILL. mpirun itself exits 1 after 2 x 5 s.
    (The closing lines may never be shown: mpirun drops what it did not read in time.)"""
    mca = [] if sigkill_after is None else ["--mca", "odls_base_sigkill_timeout",
                                            str(sigkill_after)]
    args = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", *mca, sys.executable,
            "-m", "hpctrain", "train", "--strategy", "ddp", "--model",
            "tests.fixtures.slow:factory", "--steps", "200", "--log-every", "1",
            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3", "--keep", "0",
            "--out-dir", str(tmp_path / "out"), "--requeue", "off"]
    chatty = {} if sigkill_after is None else {"SLOW_PRINT_BYTES": "2000"}
    proc = _run_until_steps(args, mpi_env({"SLOW_STEP_S": "0.1", **chatty}), tmp_path, 4)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        sent, sent_wall = time.monotonic(), time.time()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out
    files = sorted(os.listdir(tmp_path / "ck"))
    latest = (tmp_path / "ck" / "latest").read_text().strip()
    assert latest in files and not latest.endswith(".tmp"), files
    # SIGTERM may land while a periodic save is writing: SIGKILL then leaves its .tmp (never
    # named by latest), and the next start removes it, as clean_stale does here.
    tmps = [f for f in files if f.endswith(".tmp")]
    assert all(t > latest for t in tmps), files
    from hpctrain.checkpoint import clean_stale
    clean_stale(str(tmp_path / "ck"), _OneRankComm())
    assert not [f for f in os.listdir(tmp_path / "ck") if f.endswith(".tmp")]
    if sigkill_after is None:
        assert "no time to checkpoint; exiting 75" in out, out
        assert took < 10, out
    else:
        # The stop step is the last row of metrics.csv (a file: nothing lost), and its
        # checkpoint was written after the ranks' SIGTERM (T after mpirun's), before SIGKILL.
        rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
        stop = int(rows[-1].split(",")[0])
        assert latest == "ckpt-%06d.h5" % stop, (latest, rows[-1], out[-2000:])
        written = os.path.getmtime(tmp_path / "ck" / latest) - sent_wall
        assert sigkill_after - 1 < written < 2 * sigkill_after, (written, out[-2000:])
        assert took < 2 * sigkill_after + 10, took


SIGKILL_AFTER = [None, 5]


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The mpirun jobs of this file, run side by side; {test name: outcome}."""
    scenarios = {
        f"test_sigterm_to_mpirun_never_loses_a_checkpoint[{after}]":
            (lambda after=after: sigterm_to_mpirun_never_loses_a_checkpoint(
                tmp_path_factory.mktemp(f"sigterm-{after}"), after))
        for after in SIGKILL_AFTER}
    one = "test_one_signalled_rank_stops_all_at_the_same_step"
    if one in selected(request):  # the 4-rank reference run only for the test that needs it
        reference = request.getfixturevalue("reference")
        scenarios[one] = lambda: one_signalled_rank_stops_all_at_the_same_step(
            reference, tmp_path_factory.mktemp("one-signalled"))
    return SideBySide(request, scenarios)


@pytest.mark.mpi
def test_one_signalled_rank_stops_all_at_the_same_step(jobs, request):
    jobs.check(request.node.name)


@pytest.mark.mpi
@pytest.mark.parametrize("sigkill_after", SIGKILL_AFTER)
def test_sigterm_to_mpirun_never_loses_a_checkpoint(jobs, request, sigkill_after):
    jobs.check(request.node.name)
