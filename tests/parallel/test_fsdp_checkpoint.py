"""An fsdp checkpoint (element-range shards, one writer per replica group) resumes under zero3,
single and ddp at other world sizes, and theirs resume under fsdp, on the same trajectory.

The command lines run in the session's pool (tests/parallel/train_cases.py: one launch per
world size shared with the other pooled modules, each command line through hpctrain's CLI
code in-process); a checkpoint written at one world size is resumed in a later launch at
another. The 4-rank launches pretend 2 ranks per node (HYBRID_SHARD at 4 ranks: 2 nodes), as
--ranks-per-node 2 does for the fsdp command lines (the worker refuses a command line whose
ranks per node differ from its process's); at 2 ranks one node holds 2 ranks anyway.
The reference is test_zero_checkpoint's command line: the pool runs it once for both."""

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

BASE = ["--model", "tests.fixtures.awkward:factory_batchnorm",
        "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01",
        "--global-batch-size", "14", "--progress", "off", "--out-dir", ""]
FSDP = {sh: ["--strategy", "fsdp", "--sharding-strategy", sh, "--ranks-per-node", "2"]
        for sh in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")}

# (save: world, flags), (resume: world, flags)
CASES = {
    "fsdp-full-x4-to-zero3x2": ((4, FSDP["FULL_SHARD"]), (2, ["--strategy", "zero3"])),
    "zero3x2-to-fsdp-hybrid-x4": ((2, ["--strategy", "zero3"]), (4, FSDP["HYBRID_SHARD"])),
    "fsdp-hybrid-x4-to-single": ((4, FSDP["HYBRID_SHARD"]), (None, [])),
    "single-to-fsdp-grad-op-x4": ((None, []), (4, FSDP["SHARD_GRAD_OP"])),
    "fsdp-no-shard-x4-to-ddp-x2": ((4, FSDP["NO_SHARD"]), (2, ["--strategy", "ddp"])),
    "ddp-x2-to-fsdp-full-x4": ((2, ["--strategy", "ddp"]), (4, FSDP["FULL_SHARD"])),
}


def _step(cid, world, flags, steps, extra, after=()):
    launch_env = {"HPCTRAIN_RANKS_PER_NODE": "2"} if world == 4 else {}
    return {"id": cid, "world": world, "after": list(after), "launch_env": launch_env,
            "argv": BASE + ["--steps", str(steps), *flags, *extra]}


def _steps(tmp):
    """The single-process reference; per case the run that checkpoints at step 8 and the one
    that resumes it to step 16 (a checkpoint directory per case)."""
    steps = [_step("ref", None, ["--strategy", "single"], 16, [])]
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
def test_fsdp_checkpoint_resumes_anywhere(results, name):
    for cid in ("ref", f"{name}-first", f"{name}-second"):
        assert results[cid]["rc"] == 0, results[cid]["stderr"]
    ref, got = results["ref"]["summary"], results[f"{name}-second"]["summary"]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)
