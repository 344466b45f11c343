"""A ZeRO checkpoint (flat shards written as element ranges of the global tensors) resumes
under another stage, another world size, and single-process training, on the same trajectory."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi, run_single

pytestmark = pytest.mark.mpi

BASE = ["-m", "hpctrain", "train", "--model", "tests.fixtures.awkward:factory_batchnorm",
        "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01",
        "--global-batch-size", "14", "--progress", "off", "--out-dir", ""]


_reference = {}


def _train(tmp_path, name, steps, world=None, strategy="single", extra=()):
    path = tmp_path / f"{name}.json"
    args = BASE + ["--steps", str(steps), "--summary", str(path), "--strategy", strategy, *extra]
    if world is None:
        run_single(args)
    else:
        run_mpi(world, args, timeout=240)
    return json.loads(path.read_text())


@pytest.mark.parametrize("save, resume", [
    ((4, "zero2"), (2, "zero3")),
    ((2, "zero3"), (None, "single")),
    ((None, "single"), (4, "zero1")),
], ids=["zero2x4-to-zero3x2", "zero3x2-to-single", "single-to-zero1x4"])
def test_zero_checkpoint_resumes_anywhere(tmp_path, save, resume):
    if "ref" not in _reference:
        _reference["ref"] = _train(tmp_path, "ref", 16)
    ref = _reference["ref"]
    ck = tmp_path / "ck"
    _train(tmp_path, "first", 8, save[0], save[1], ["--checkpoint-dir", str(ck)])
    got = _train(tmp_path, "second", 16, resume[0], resume[1],
                 ["--checkpoint-dir", str(ck), "--resume", "auto"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)
