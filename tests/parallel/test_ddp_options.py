"""Every trainer option works with ddp: activation checkpointing, bf16/fp16, compression, clipping.

The command lines run in two processes (tests/parallel/train_worker.py runs each through
hpctrain's CLI code in-process): the references alone, the 2-rank runs under one mpirun. The
no-fusion case is a real ``python -m hpctrain train`` under mpirun: Horovod reads its fusion
threshold once per process, so it needs a process of its own anyway."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

BASE = ["--model", "gpt", "--steps", "12", "--global-batch-size", "12", "--progress", "off",
        "--out-dir", ""]
AC = ["--max-grad-norm", "0.5", "--activation-checkpointing", "--grad-accum", "2"]
LOW = {"bf16": ["--precision", "bf16"], "fp16": ["--precision", "fp16"],
       "fp16-compression": ["--fp16-compression"], "no-fusion": ["--fusion-threshold-mb", "0"]}
CLI = "no-fusion"  # run as a real CLI launch


def _steps(tmp):
    steps = [{"id": "ref-clip", "world": None, "argv": BASE + ["--max-grad-norm", "0.5"]},
             {"id": "ref", "world": None, "argv": BASE},
             {"id": "ac", "world": 2, "argv": BASE + AC + ["--strategy", "ddp"]}]
    steps += [{"id": name, "world": 2, "argv": BASE + extra + ["--strategy", "ddp"]}
              for name, extra in LOW.items() if name != CLI]
    return steps


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


def _summary(results, cid):
    got = results[cid]
    assert got["rc"] == 0, got["stderr"]
    return got["summary"]


def test_activation_checkpointing_and_clipping_are_exact(results):
    ref, got = _summary(results, "ref-clip"), _summary(results, "ac")
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)


@pytest.mark.parametrize("name", list(LOW))
def test_low_precision_options_track_fp32(results, tmp_path, name):
    ref = _summary(results, "ref")
    if name == CLI:
        path = tmp_path / "opt.json"
        run_mpi(2, ["-m", "hpctrain", "train", *BASE, *LOW[name], "--strategy", "ddp",
                    "--summary", str(path)], timeout=240)
        got = json.loads(path.read_text())
    else:
        got = _summary(results, name)
    # Low precision changes the arithmetic, not the trajectory: close, and still learning.
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=3e-2)
    assert got["losses"][-1] < got["losses"][0] - 0.3
