"""An fsdp checkpoint (element-range shards, one writer per replica group) resumes under zero3,
single and ddp at other world sizes, and theirs resume under fsdp, on the same trajectory."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi, run_single

pytestmark = pytest.mark.mpi

BASE = ["-m", "hpctrain", "train", "--model", "tests.fixtures.awkward:factory_batchnorm",
        "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01",
        "--global-batch-size", "14", "--progress", "off", "--out-dir", ""]
FSDP = {sh: ["--strategy", "fsdp", "--sharding-strategy", sh, "--ranks-per-node", "2"]
        for sh in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")}

_reference = {}


def _train(tmp_path, name, steps, world, extra):
    path = tmp_path / f"{name}.json"
    args = BASE + ["--steps", str(steps), "--summary", str(path), *extra]
    if world is None:
        run_single(args)
    else:
        run_mpi(world, args, timeout=240)
    return json.loads(path.read_text())


# (save: world, flags), (resume: world, flags)
CASES = {
    "fsdp-full-x4-to-zero3x2": ((4, FSDP["FULL_SHARD"]), (2, ["--strategy", "zero3"])),
    "zero3x2-to-fsdp-hybrid-x4": ((2, ["--strategy", "zero3"]), (4, FSDP["HYBRID_SHARD"])),
    "fsdp-hybrid-x4-to-single": ((4, FSDP["HYBRID_SHARD"]), (None, [])),
    "single-to-fsdp-grad-op-x4": ((None, []), (4, FSDP["SHARD_GRAD_OP"])),
    "fsdp-no-shard-x4-to-ddp-x2": ((4, FSDP["NO_SHARD"]), (2, ["--strategy", "ddp"])),
    "ddp-x2-to-fsdp-full-x4": ((2, ["--strategy", "ddp"]), (4, FSDP["FULL_SHARD"])),
}


@pytest.mark.parametrize("name", CASES)
def test_fsdp_checkpoint_resumes_anywhere(tmp_path, name):
    save, resume = CASES[name]
    if "ref" not in _reference:
        _reference["ref"] = _train(tmp_path, "ref", 16, None, [])
    ref = _reference["ref"]
    ck = tmp_path / "ck"
    _train(tmp_path, "first", 8, save[0], [*save[1], "--checkpoint-dir", str(ck)])
    got = _train(tmp_path, "second", 16, resume[0],
                 [*resume[1], "--checkpoint-dir", str(ck), "--resume", "auto"])
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)
