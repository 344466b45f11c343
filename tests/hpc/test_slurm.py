"""hpctrain under a real SLURM: srun equals mpirun; every SLURM script in jobs/ runs; pre-emption.

The cluster is one machine (tests/hpc/slurm_cluster.py), so the site-specific lines of the
scripts are parameterised the way a user would edit them: nodes=2 -> 1, 8 cores per GPU
rank -> 2 (the VM has 2 cores; the node declares 16). GPUs are fake gres devices: SLURM
accounts them and sets CUDA_VISIBLE_DEVICES, torch finds no CUDA and the ranks train on CPU.
The jobs run side by side (tests/hpc/side_by_side.py): they mostly wait on the scheduler's
passes, the paced steps and the requeue hold; each test checks its own job.
"""

import csv
import json
import os
import re
import sys
import time

import numpy as np
import pytest

from tests.hpc.conftest import REF_ARGS, VENV, copy_job
from tests.hpc.side_by_side import SideBySide

pytestmark = pytest.mark.slurm

PY = [sys.executable, "-m", "hpctrain", "train", "--strategy", "ddp", "--progress", "off",
      "--out-dir", ""]


def _summary(path):
    with open(path) as fh:
        return json.load(fh)


def _assert_losses(got, ref, rtol=1e-6):
    assert len(got["losses"]) == len(ref["losses"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=rtol, atol=0)


def srun_matches_mpirun(slurm, reference, tmp_path):
    out = tmp_path / "srun.json"
    proc = slurm.run(["srun", "-n", "4", "--mpi=pmix"] + PY + REF_ARGS + ["--summary", str(out)],
                     timeout=240, cwd=str(tmp_path))
    # The one start line, from rank 0 only.
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("hpctrain: launcher=")]
    assert lines == ["hpctrain: launcher=slurm ranks=4 nodes=1 ranks/node=4 device=cpu "
                     "comm=mpi mesh=dp=4 strategy=ddp"], proc.stdout
    got = _summary(out)
    assert got["world_size"] == 4
    _assert_losses(got, reference)


def _sbatch(slurm, script, cwd, env, timeout=240):
    job = slurm.run(["sbatch", "--parsable", script], cwd=cwd, env=env).stdout.strip()
    job = job.split(";")[0]
    state = slurm.wait_job(job, timeout)
    return job, state


def _log(cwd, pattern):
    names = [n for n in os.listdir(cwd) if re.fullmatch(pattern, n)]
    assert len(names) == 1, (pattern, os.listdir(cwd))
    with open(os.path.join(cwd, names[0])) as fh:
        return fh.read()


# kind -> (script, cpus per task, site edits)
SCRIPTS = {
    "cpu": ("slurm-cpu.sbatch", 1, []),
    # multi-node GPU script on the one-node cluster: the two lines a site sizes
    "gpu": ("slurm-gpu.sbatch", 2, [("#SBATCH --nodes=2", "#SBATCH --nodes=1"),
                                    ("#SBATCH --cpus-per-task=8", "#SBATCH --cpus-per-task=2")]),
}


def sbatch_job_script(slurm, reference, tmp_path, name, cpus, edits):
    script = copy_job(name, str(tmp_path), edits)
    # SLURM_DEBUG=1: srun -v, which prints the options its step was given
    job, state = _sbatch(slurm, script, str(tmp_path), {"MODEL": "mlp", "STEPS": "20",
                                                         "SLURM_DEBUG": "1"})
    log = _log(str(tmp_path), r"hpctrain-(cpu|gpu)-\d+\.out")
    assert state == "COMPLETED", log + slurm.logs()
    # Slurm >= 22.05 gives srun's step the job's cpus-per-task only through
    # SRUN_CPUS_PER_TASK (without it srun -v prints no cpus-per-task: one core per rank)
    assert re.search(rf"^srun: cpus-per-task\s*: {cpus}$", log, re.M), log
    assert "hpctrain: launcher=slurm ranks=4 nodes=1 ranks/node=4 device=cpu" in log, log
    assert f"hpctrain: python is {VENV}/bin/python" in log, log
    assert "hpctrain exit code 0" in log
    final = re.search(r"done: 20 steps, loss [\d.]+ -> ([\d.]+)", log)
    assert final and abs(float(final.group(1)) - reference["final_loss"]) < 5e-5, log
    got = _summary(tmp_path / f"{'hpctrain-gpu' if 'gpu' in name else 'hpctrain-cpu'}-{job}.json")
    _assert_losses(got, reference)


def _steps_done(csv_path):
    try:
        with open(csv_path) as fh:
            return max((int(r["step"]) for r in csv.DictReader(fh)), default=0)
    except (OSError, ValueError, KeyError):
        return 0


def _wait_steps(slurm, job, csv_path, n, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _steps_done(csv_path) >= n:
            return
        state = slurm.job_state(job)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state}"
        time.sleep(0.2)
    raise AssertionError(f"job {job} did not reach step {n} in {timeout}s\n{slurm.logs()}")


def _start_requeued(slurm, job, timeout=120):
    """SLURM holds a requeued job ~120 s (BeginTime); start it now to keep the test short.

    Restarts counts up when the requeue is requested, while the first run is still ending
    (RUNNING, COMPLETING...): only PENDING means the requeued job is waiting. slurmd revokes
    the first run's credential with a one-second timestamp; a relaunch within that same second
    is refused ("Job credential revoked") and the job fails, so let a few seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if slurm.job_field(job, "Restarts") not in ("", "0") and \
                slurm.job_state(job) == "PENDING":
            time.sleep(3)
            slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job} was not requeued in {timeout}s\n{slurm.logs()}")


PREEMPT_ENV = {"MODEL": "tests.fixtures.slow:factory", "STEPS": "20", "CKPT_EVERY": "100",
               "SLOW_STEP_S": "0.3"}


def preempt_requeue_resume(slurm, reference, tmp_path):
    """USR1 mid-run: checkpoint, scontrol requeue, restart, --resume auto: same losses."""
    script = copy_job("slurm-preempt.sbatch", str(tmp_path))
    job = slurm.run(["sbatch", "--parsable", script], cwd=str(tmp_path),
                    env=PREEMPT_ENV).stdout.strip().split(";")[0]
    _wait_steps(slurm, job, tmp_path / "hpctrain-out" / "metrics.csv", 4)
    slurm.run(["scancel", "--signal=USR1", job])
    _start_requeued(slurm, job)
    state = slurm.wait_job(job, 240)
    log = _log(str(tmp_path), r"hpctrain-preempt-\d+\.out")
    assert state == "COMPLETED", log + slurm.logs()
    m = re.search(r"SIGUSR1 received; stopped after step (\d+), checkpoint (\S+)", log)
    assert m, log
    stopped = int(m.group(1))
    assert 4 <= stopped < 20
    # scontrol requeue ends the batch script at once: no "exit code" line from the first run.
    assert "job requeued; it continues from the checkpoint" in log, log
    assert log.count("hpctrain exit code") == 1, log
    assert f"resumed from {m.group(2)} at step {stopped}" in log, log
    assert log.rstrip().endswith("hpctrain exit code 0"), log
    _assert_losses(_summary(tmp_path / f"hpctrain-preempt-{job}.json"), reference)


def killed_job_loses_at_most_checkpoint_every(slurm, reference, tmp_path):
    """No warning signal (SIGKILL, like a hard time limit): resume loses <= every steps."""
    every = 4
    env = dict(PREEMPT_ENV, CKPT_EVERY=str(every))
    script = copy_job("slurm-preempt.sbatch", str(tmp_path))
    csv_path = tmp_path / "hpctrain-out" / "metrics.csv"
    job = slurm.run(["sbatch", "--parsable", "--no-requeue", script], cwd=str(tmp_path),
                    env=env).stdout.strip().split(";")[0]
    _wait_steps(slurm, job, csv_path, 10)
    slurm.run(["scancel", "--full", "--signal=KILL", job])
    slurm.wait_job(job, 120)
    done = _steps_done(csv_path)
    assert 10 <= done < 20
    # Resubmitting the same script continues from the newest checkpoint (unpaced: nothing
    # signals it).
    job2, state = _sbatch(slurm, script, str(tmp_path), dict(env, SLOW_STEP_S="0"))
    log = (tmp_path / f"hpctrain-preempt-{job2}.out").read_text()
    assert state == "COMPLETED", log
    m = re.search(r"resumed from \S+ at step (\d+)", log)
    assert m, log
    assert done - every <= int(m.group(1)) <= done
    _assert_losses(_summary(tmp_path / f"hpctrain-preempt-{job2}.json"), reference)


@pytest.fixture(scope="module")
def jobs(request, slurm, reference, tmp_path_factory):
    """Every job of this file, run side by side; {test name: outcome}."""
    def body(fn, tmp_name, *args):
        return lambda: fn(slurm, reference, tmp_path_factory.mktemp(tmp_name), *args)

    scenarios = {f"test_sbatch_job_script[{kind}]": body(sbatch_job_script, kind, *spec)
                 for kind, spec in SCRIPTS.items()}
    for fn in (srun_matches_mpirun, preempt_requeue_resume,
               killed_job_loses_at_most_checkpoint_every):
        scenarios["test_" + fn.__name__] = body(fn, fn.__name__[:20])
    return SideBySide(request, scenarios)


def test_srun_matches_mpirun(jobs, request):
    jobs.check(request.node.name)


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_sbatch_job_script(jobs, request, kind):
    jobs.check(request.node.name)


def test_preempt_requeue_resume(jobs, request):
    jobs.check(request.node.name)


def test_killed_job_loses_at_most_checkpoint_every(jobs, request):
    jobs.check(request.node.name)
