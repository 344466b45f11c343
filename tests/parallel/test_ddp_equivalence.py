"""Horovod DDP at 1, 2 and 4 ranks reproduces single-process training (fp32, rtol 1e-5)."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi, run_single

pytestmark = pytest.mark.mpi

# A global batch of 14 splits unevenly over 4 ranks (4,4,3,3) and, with grad_accum=2,
# into micro-batches of 7 that split 2,2,2,1.
COMMON = ["--steps", "20", "--global-batch-size", "14", "--weight-decay", "0.01",
          "--progress", "off", "--out-dir", ""]

# (model, optimizer, grad_accum, lr)
CASES = [
    ("mlp", "sgd", 1, "0.1"), ("mlp", "adamw", 1, "0.003"),
    ("mlp", "sgd", 2, "0.1"), ("mlp", "adamw", 2, "0.003"),
    ("gpt", "sgd", 1, "0.3"), ("gpt", "adamw", 1, "0.003"),
    ("gpt", "sgd", 2, "0.3"), ("gpt", "adamw", 2, "0.003"),
    # uneven sizes, tied weight, buffer, frozen and never-used parameters
    ("tests.fixtures.awkward:factory", "adamw", 1, "0.003"),
    ("tests.fixtures.awkward:factory", "sgd", 2, "0.3"),
    # BatchNorm running statistics: synchronized over ranks
    ("tests.fixtures.awkward:factory_batchnorm", "adamw", 2, "0.003"),
]

_reference = {}


def _args(model, opt, accum, lr, summary):
    return ["-m", "hpctrain", "train", "--model", model, "--optimizer", opt, "--grad-accum",
            str(accum), "--lr", lr, "--summary", str(summary)] + COMMON


def _single(tmp_path_factory, case):
    if case not in _reference:
        path = tmp_path_factory.mktemp("single") / "summary.json"
        run_single(_args(*case, path))
        _reference[case] = json.loads(path.read_text())
    return _reference[case]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].split(':')[-1]}-{c[1]}-accum{c[2]}")
def test_ddp_matches_single(tmp_path_factory, tmp_path, case, world):
    ref = _single(tmp_path_factory, case)
    path = tmp_path / "ddp.json"
    run_mpi(world, _args(*case, path) + ["--strategy", "ddp"], timeout=240)
    got = json.loads(path.read_text())
    assert got["world_size"] == world and got["strategy"] == "ddp"
    assert len(got["losses"]) == 20
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)
    if case[1] == "adamw":  # it learned something (sgd over 20 noisy steps need not)
        assert np.mean(ref["losses"][-5:]) < np.mean(ref["losses"][:5])


def test_ddp_one_rank_matches_single(tmp_path_factory, tmp_path):
    case = CASES[1]
    ref = _single(tmp_path_factory, case)
    path = tmp_path / "ddp1.json"
    run_mpi(1, _args(*case, path) + ["--strategy", "ddp"], timeout=240)
    np.testing.assert_allclose(json.loads(path.read_text())["losses"], ref["losses"], rtol=1e-5)
