"""The command line end to end: default run, config errors, the abort on a failing rank."""

import json
import time

import pytest

from tests.mpirun import run_mpi, run_single


def test_default_single_run_learns(tmp_path):
    summary = tmp_path / "s.json"
    proc = run_single(["-m", "hpctrain", "train", "--steps", "60", "--summary", str(summary),
                       "--out-dir", str(tmp_path / "out")])
    s = json.loads(summary.read_text())
    for key in ("strategy", "world_size", "steps", "losses", "final_loss", "param_norm",
                "tokens_or_samples_per_s", "peak_rss_mb"):
        assert key in s
    assert s["strategy"] == "single" and s["world_size"] == 1 and s["steps"] == 60
    assert s["final_loss"] < 0.6 * s["losses"][0]
    assert s["unit"] == "tokens" and s["tokens_or_samples_per_s"] > 0
    rows = (tmp_path / "out" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,units_per_s,elapsed_s" and len(rows) == 61
    assert "launcher=single" in proc.stdout and "done: 60 steps" in proc.stdout


@pytest.mark.parametrize("flags, words", [
    (["--steps", "0"], "train.steps = 0: must be >= 1"),
    (["--optimizer", "lamb"], "train.optimizer = 'lamb'"),
    (["--model", "no.such.module:factory"], "no.such.module"),
    (["--model", "resnet"], "resnet"),
    (["--mesh", "dp=3"], "multiply to 3, not 1"),
])
def test_bad_input_exits_2_with_one_line(flags, words):
    proc = run_single(["-m", "hpctrain", "train", "--progress", "off"] + flags, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error:") and words in lines[0], lines


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
    assert "[hpctrain rank 1/4" in proc.stderr
    assert "injected failure at forward call 3" in proc.stderr


def test_doctor_runs_clean():
    proc = run_single(["-m", "hpctrain", "doctor"], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
