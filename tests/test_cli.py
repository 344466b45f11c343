"""The command line end to end: default run, config errors, the abort on a failing rank."""

import json
import os
import re
import time

import pytest

from hpctrain.train.nonfinite import NONFINITE_EXIT_CODE
from tests.mpirun import run_mpi, run_single


def test_default_single_run_learns(tmp_path):
    summary = tmp_path / "s.json"
    proc = run_single(["-m", "hpctrain", "train", "--steps", "60", "--summary", str(summary),
                       "--out-dir", str(tmp_path / "out")])
    s = json.loads(summary.read_text())
    for key in ("strategy", "world_size", "steps", "losses", "final_loss", "param_norm",
                "tokens_or_samples_per_s", "peak_rss_mb", "lr", "lr_schedule", "seed"):
        assert key in s
    assert s["strategy"] == "single" and s["world_size"] == 1 and s["steps"] == 60
    assert s["final_loss"] < 0.6 * s["losses"][0]
    assert s["unit"] == "tokens" and s["tokens_or_samples_per_s"] > 0
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,units_per_s,elapsed_s,grad_norm,peak_rss_mb,val_loss" \
        and len(rows) == 61
    assert "launcher=single" in proc.stdout and "done: 60 steps" in proc.stdout


@pytest.mark.mpi
def test_bad_config_fails_on_every_rank_before_mpi():
    proc = run_mpi(4, ["-m", "hpctrain", "train", "--strategy", "ddp", "--steps", "-3"],
                   check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("hpctrain: error: train.steps = -3") == 1


@pytest.mark.mpi
def test_single_strategy_refuses_many_ranks():
    proc = run_mpi(2, ["-m", "hpctrain", "train"], check=False, timeout=60)
    assert proc.returncode == 2 and "launcher started 2 ranks" in proc.stderr


@pytest.mark.mpi
def test_one_failing_rank_aborts_the_job():
    start = time.monotonic()
    proc = run_mpi(4, ["-m", "hpctrain", "train", "--strategy", "ddp", "--steps", "50",
                       "--model", "tests.fixtures.faulty:factory", "--progress", "off",
                       "--out-dir", ""], check=False, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f}s to abort"
    assert "[hpctrain rank 1/4" in proc.stderr and "at step 3]" in proc.stderr, proc.stderr
    assert "injected failure at forward call 3" in proc.stderr


def test_doctor_runs_clean():
    proc = run_single(["-m", "hpctrain", "doctor"], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _train(tmp_path, *flags, check=False, env=None):
    return run_single(["-m", "hpctrain", "train", "--model", "mlp", "--progress", "off",
                       "--out-dir", str(tmp_path / "out"), *flags], check=check, env=env)


def _one_error_line(proc, words):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error:") and words in lines[0], \
        proc.stderr


def test_processes_mpi_does_not_join_are_refused_each():
    # torchrun's environment: N processes, no MPI launcher; refused before MPI starts.
    import subprocess
    import sys

    from tests.mpirun import ROOT, mpi_env

    procs = []
    for rank in (0, 1):
        env = mpi_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpctrain", "train", "--strategy", "ddp", "--model", "mlp",
             "--out-dir", ""], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, out + err
        _one_error_line(subprocess.CompletedProcess([], 2, out, err),
                        "torchrun launcher started 2 processes, but no MPI launcher")
    # srun without a PMI plugin: SLURM says 2 tasks, MPI initialises a world of 1.
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    proc = _train_env(slurm)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _one_error_line(proc, "slurm launcher started 2 processes, but MPI sees 1 rank(s)")
    doctor = run_single(["-m", "hpctrain", "doctor"], check=False,
                        env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert doctor.returncode == 1, doctor.stdout
    assert "torchrun launcher started 2 processes, but MPI sees 1 rank(s)" in doctor.stdout


def _train_env(env):
    return run_single(["-m", "hpctrain", "train", "--strategy", "ddp", "--model", "mlp",
                       "--out-dir", "", "--progress", "off"], check=False, env=env)


def test_nonfinite_loss_stops_without_touching_good_checkpoints(tmp_path):
    import h5py
    import numpy as np

    ck = tmp_path / "ck"
    proc = _train(tmp_path, "--lr", "1e6", "--steps", "40", "--checkpoint-dir", str(ck),
                  "--checkpoint-every", "1", "--keep", "2")
    assert proc.returncode == NONFINITE_EXIT_CODE, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    m = re.search(r"hpctrain: error: step (\d+): (the loss is \w+|gradient of '[\w.]+' is not "
                  r"finite)",
                  proc.stderr)
    assert m, proc.stderr
    bad = int(m.group(1))
    for name in sorted(os.listdir(ck)):
        if name.startswith("ckpt-"):
            assert int(name[5:11]) < bad
            with h5py.File(ck / name) as f:
                f.visititems(lambda n, d: isinstance(d, h5py.Dataset) and n.startswith(
                    "model/") and np.testing.assert_array_equal(np.isfinite(d[()]), True))


def test_parameters_gone_nonfinite_are_never_saved(tmp_path):
    ck = tmp_path / "ck"
    proc = _train(tmp_path, "--model", "tests.fixtures.nonfinite:factory", "--steps", "5",
                  "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert proc.returncode == NONFINITE_EXIT_CODE, proc.stdout + proc.stderr
    assert "hpctrain: error: step 2: the parameters are not finite" in proc.stderr, proc.stderr
    assert "newest good one is " + str(ck / "ckpt-000001.h5") in proc.stderr
    assert sorted(n for n in os.listdir(ck) if n.startswith("ckpt-")) == ["ckpt-000001.h5"]


def test_resume_appends_metrics_and_a_finished_checkpoint_trains_nothing(tmp_path):
    ck, summary = tmp_path / "ck", tmp_path / "s.json"
    common = ["--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--keep", "0",
              "--summary", str(summary)]
    _train(tmp_path, "--steps", "8", *common, check=True)
    assert "hpctrain: checkpoint written: " in _train(tmp_path, "--steps", "9", *common,
                                                      "--resume", "auto", check=True).stdout
    os.remove(ck / "ckpt-000009.h5")
    os.remove(ck / "ckpt-000008.h5")  # as if killed after step 9 with the last save at 5
    _train(tmp_path, "--steps", "10", *common, "--resume", "auto", check=True)
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(1, 11)]
    done = _train(tmp_path, "--steps", "5", *common, "--resume", "auto", check=True)
    assert "checkpoint is at step 10, already at or past train.steps = 5" in done.stdout
    assert "done:" not in done.stdout
    s = json.loads(summary.read_text())
    assert s["steps"] == 10 and s["trained_steps"] == 0 and len(s["losses"]) == 10
    assert s["tokens_or_samples_per_s"] is None


@pytest.mark.parametrize("flags, words", [
    (["--checkpoint-dir", "{file}"], "checkpoint.dir (--checkpoint-dir) = "),
    (["--out-dir", "{file}/sub"], "train.out_dir (--out-dir) = "),
    (["--device", "cuda"], "runtime.device = 'cuda' (--device) but no CUDA device"),
    (["--global-batch-size", "100000"], "has only"),
    (["--strategy", "ddp", "--sharding-strategy", "NO_SHARD"], "does not read [fsdp]"),
])
def test_unusable_paths_and_devices_fail_before_mpi(tmp_path, flags, words):
    f = tmp_path / "file"
    f.write_text("")
    proc = _train(tmp_path, *[x.replace("{file}", str(f)) for x in flags])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _one_error_line(proc, words)


def test_unwritable_data_dir_is_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    proc = run_single(["-m", "hpctrain", "train", "--model", "unet", "--progress", "off",
                       "--out-dir", ""], check=False, env={"HPCTRAIN_DATA_DIR": str(f / "d")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _one_error_line(proc, "cannot build its data set")


@pytest.mark.mpi
def test_a_usage_error_on_every_rank_is_one_line_without_traceback():
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--strategy", "ddp", "--steps", "5",
                       "--model", "tests.fixtures.faulty:factory", "--progress", "off",
                       "--out-dir", ""], env={"FAULTY_RANK": "all", "FAULTY_KIND": "usage"},
                   check=False, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.count("hpctrain: error: injected usage error at forward call 3") == 1, \
        proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_ABORT" not in proc.stderr


@pytest.mark.mpi
def test_a_usage_error_on_one_rank_names_it_and_aborts():
    start = time.monotonic()
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--strategy", "ddp", "--steps", "50",
                       "--model", "tests.fixtures.faulty:factory", "--progress", "off",
                       "--out-dir", ""], env={"FAULTY_RANK": "1", "FAULTY_KIND": "usage"},
                   check=False, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "hpctrain: error: rank 1 at step 3: injected usage error" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_rank_not_torn_down_still_prints_the_config_error():
    # Rank 1 of a launch that does not stop at rank 0's exit: it says it itself.
    proc = run_single(["-m", "hpctrain", "train", "--steps", "0"], check=False,
                      env={"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
                           "SLURM_PROCID": "1", "SLURM_LOCALID": "1"})
    assert proc.returncode == 2
    _one_error_line(proc, "train.steps = 0: must be >= 1")


@pytest.mark.mpi
def test_an_exception_in_a_python_api_script_aborts_every_rank(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(
        "import time, torch, hpctrain\n"
        "world = hpctrain.init()\n"
        "par = hpctrain.parallelize(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1),"
        " strategy='ddp')\n"
        "if world.rank == 1:\n"
        "    raise KeyError('user bug on rank 1')\n"
        "world.host.barrier()\n"
        "time.sleep(120)\n")
    start = time.monotonic()
    proc = run_mpi(2, [str(script)], check=False, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "[hpctrain rank 1/2" in proc.stderr and "user bug on rank 1" in proc.stderr
