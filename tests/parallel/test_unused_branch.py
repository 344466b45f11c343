"""A branch taken on some ranks only (data-dependent unused parameters): zero1 and zero2
reduce every unit in one fixed order, zero3 and fsdp also gather the units in one canonical
stream every rank walks in full (hpctrain.parallel.sharding.schedule), so none deadlocks or
pairs mismatched collectives, and all train exactly as Horovod ddp does on the same ranks:
with grad accumulation, activation checkpointing, backward prefetch on and off, SHARD_GRAD_OP
and HYBRID_SHARD, and for a model that also runs blocks out of registration order and one
twice (the same on every rank).

The command lines run many per launch (tests/parallel/train_worker.py), one launch per world
size; every launch pretends 2 ranks per node (HYBRID_SHARD at 4 ranks: 2 nodes)."""

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

BASE = ["--steps", "20", "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01",
        "--progress", "off", "--out-dir", ""]
BRANCHY = ["--model", "tests.fixtures.branchy:factory"]
REORDERED = ["--model", "tests.fixtures.branchy:factory_reordered"]
FSDP = ["--strategy", "fsdp"]

# id: (world, flags); each is compared with the ddp case of the same world and "-suffix".
CASES = {
    "ddp-x2": (2, BRANCHY + ["--strategy", "ddp", "--global-batch-size", "4"]),
    "zero1-x2": (2, BRANCHY + ["--strategy", "zero1", "--global-batch-size", "4"]),
    "zero2-x2": (2, BRANCHY + ["--strategy", "zero2", "--global-batch-size", "4"]),
    "zero3-x2": (2, BRANCHY + ["--strategy", "zero3", "--global-batch-size", "4"]),
    "fsdp-x2": (2, BRANCHY + FSDP + ["--global-batch-size", "4"]),
    "fsdp-no-prefetch-x2": (2, BRANCHY + FSDP + ["--global-batch-size", "4",
                                                 "--set", "fsdp.backward_prefetch=NONE"]),
    "fsdp-grad-op-x2": (2, BRANCHY + FSDP + ["--global-batch-size", "4",
                                             "--sharding-strategy", "SHARD_GRAD_OP"]),
    "ddp-x2-accum": (2, BRANCHY + ["--strategy", "ddp", "--global-batch-size", "4",
                                   "--grad-accum", "2"]),
    "zero3-x2-accum": (2, BRANCHY + ["--strategy", "zero3", "--global-batch-size", "4",
                                     "--grad-accum", "2"]),
    "fsdp-x2-accum": (2, BRANCHY + FSDP + ["--global-batch-size", "4", "--grad-accum", "2"]),
    "fsdp-grad-op-x2-accum": (2, BRANCHY + FSDP + ["--global-batch-size", "4", "--grad-accum",
                                                   "2", "--sharding-strategy", "SHARD_GRAD_OP"]),
    "ddp-x2-recompute": (2, BRANCHY + ["--strategy", "ddp", "--global-batch-size", "4",
                                       "--activation-checkpointing"]),
    "zero3-x2-recompute": (2, BRANCHY + ["--strategy", "zero3", "--global-batch-size", "4",
                                         "--activation-checkpointing"]),
    "fsdp-x2-recompute": (2, BRANCHY + FSDP + ["--global-batch-size", "4",
                                               "--activation-checkpointing"]),
    "ddp-x2-reordered": (2, REORDERED + ["--strategy", "ddp", "--global-batch-size", "4"]),
    "zero3-x2-reordered": (2, REORDERED + ["--strategy", "zero3", "--global-batch-size", "4"]),
    "fsdp-x2-reordered": (2, REORDERED + FSDP + ["--global-batch-size", "4"]),
    "fsdp-grad-op-x2-reordered": (2, REORDERED + FSDP + ["--global-batch-size", "4",
                                                         "--sharding-strategy", "SHARD_GRAD_OP"]),
    "ddp-x4": (4, BRANCHY + ["--strategy", "ddp", "--global-batch-size", "4"]),
    "zero3-x4": (4, BRANCHY + ["--strategy", "zero3", "--global-batch-size", "4"]),
    "fsdp-x4": (4, BRANCHY + FSDP + ["--global-batch-size", "4"]),
    "fsdp-hybrid-x4": (4, BRANCHY + FSDP + ["--global-batch-size", "4",
                                            "--sharding-strategy", "HYBRID_SHARD"]),
    "ddp-x4-accum": (4, BRANCHY + ["--strategy", "ddp", "--global-batch-size", "8",
                                   "--grad-accum", "2"]),
    "zero3-x4-accum": (4, BRANCHY + ["--strategy", "zero3", "--global-batch-size", "8",
                                     "--grad-accum", "2"]),
}


def _reference(cid: str) -> str:
    flavour, rest = cid.split("-x", 1)
    return "ddp-x" + rest


def _steps(tmp):
    # two pretend nodes at 4 ranks (HYBRID_SHARD); at 2 ranks one node, as without it
    return [{"id": cid, "world": world, "argv": BASE + flags,
             "launch_env": {"HPCTRAIN_RANKS_PER_NODE": "2"} if world == 4 else {}}
            for cid, (world, flags) in CASES.items()]


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.parametrize("cid", [c for c in CASES if not c.startswith("ddp-")])
def test_data_dependent_branches_train_as_ddp(results, cid):
    ref = _reference(cid)
    for c in (ref, cid):
        assert results[c]["rc"] == 0, results[c]["stderr"]
    got, want = results[cid]["summary"], results[ref]["summary"]
    assert len(got["losses"]) == 20
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["param_norm"], want["param_norm"], rtol=1e-5)
