"""A ZeRO checkpoint (flat shards written as element ranges of the global tensors) resumes
under another stage, another world size, and single-process training, on the same trajectory.

The command lines run in the session's pool (tests/parallel/train_cases.py: one launch per
world size shared with the other pooled modules, each command line through hpctrain's CLI
code in-process); a checkpoint written at one world size is resumed in a later launch at
another."""

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

BASE = ["--model", "tests.fixtures.awkward:factory_batchnorm",
        "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01",
        "--global-batch-size", "14", "--progress", "off", "--out-dir", ""]

CASES = {
    "zero2x4-to-zero3x2": ((4, "zero2"), (2, "zero3")),
    "zero3x2-to-single": ((2, "zero3"), (None, "single")),
    "single-to-zero1x4": ((None, "single"), (4, "zero1")),
}


def _step(cid, world, strategy, steps, extra, after=()):
    return {"id": cid, "world": world, "after": list(after),
            "argv": BASE + ["--steps", str(steps), "--strategy", strategy, *extra]}


def _steps(tmp):
    """The single-process reference; per case the run that checkpoints at step 8 and the one
    that resumes it to step 16 (a checkpoint directory per case)."""
    steps = [_step("ref", None, "single", 16, [])]
    for name, (save, resume) in CASES.items():
        ck = ["--checkpoint-dir", str(tmp / name / "ck")]
        steps.append(_step(f"{name}-first", *save, 8, ck))
        steps.append(_step(f"{name}-second", *resume, 16, ck + ["--resume", "auto"],
                           after=[f"{name}-first"]))
    return steps


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.parametrize("name", CASES)
def test_zero_checkpoint_resumes_anywhere(results, name):
    for cid in ("ref", f"{name}-first", f"{name}-second"):
        assert results[cid]["rc"] == 0, results[cid]["stderr"]
    ref, got = results["ref"]["summary"], results[f"{name}-second"]["summary"]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)
