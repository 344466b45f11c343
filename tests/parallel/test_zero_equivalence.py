"""ZeRO stages 1-3 at 2 and 4 ranks reproduce single-process training (fp32, rtol 1e-5)."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi, run_single

pytestmark = pytest.mark.mpi

# A global batch of 14 splits unevenly over 4 ranks (4,4,3,3) and, with grad_accum=2,
# into micro-batches of 7 that split 2,2,2,1.
COMMON = ["--steps", "20", "--global-batch-size", "14", "--weight-decay", "0.01",
          "--progress", "off", "--out-dir", ""]
LR = {("mlp", "sgd"): "0.1", ("gpt", "sgd"): "0.3", ("awkward", "sgd"): "0.3"}
SPEC = {"mlp": "mlp", "gpt": "gpt", "awkward": "tests.fixtures.awkward:factory",
        "awkward_bn": "tests.fixtures.awkward:factory_batchnorm"}

# (world, strategy, model, optimizer, grad_accum): every stage meets every model, both
# optimizers, both world sizes and both accumulation settings; not the full product.
CASES = [
    (2, "zero1", "mlp", "sgd", 1), (4, "zero1", "mlp", "adamw", 2),
    (2, "zero1", "gpt", "adamw", 1), (4, "zero1", "gpt", "sgd", 2),
    (2, "zero1", "awkward", "adamw", 2), (4, "zero1", "awkward", "sgd", 1),
    (4, "zero1", "awkward_bn", "adamw", 2),
    (2, "zero2", "mlp", "adamw", 1), (4, "zero2", "mlp", "sgd", 2),
    (2, "zero2", "gpt", "sgd", 2), (4, "zero2", "gpt", "adamw", 1),
    (4, "zero2", "awkward", "adamw", 2), (2, "zero2", "awkward", "sgd", 1),
    (2, "zero2", "awkward_bn", "adamw", 1), (4, "zero2", "awkward_bn", "sgd", 2),
    (2, "zero3", "mlp", "adamw", 2), (4, "zero3", "mlp", "sgd", 1),
    (2, "zero3", "gpt", "adamw", 2), (4, "zero3", "gpt", "adamw", 1),
    (4, "zero3", "gpt", "sgd", 2),
    (2, "zero3", "awkward", "adamw", 1), (4, "zero3", "awkward", "sgd", 2),
    (4, "zero3", "awkward_bn", "adamw", 2), (2, "zero3", "awkward_bn", "sgd", 1),
]

_reference = {}


def _args(model, opt, accum, summary):
    lr = LR.get((model.removesuffix("_bn"), opt), "0.003")
    return ["-m", "hpctrain", "train", "--model", SPEC[model], "--optimizer", opt,
            "--grad-accum", str(accum), "--lr", lr, "--summary", str(summary)] + COMMON


def _single(tmp_path_factory, model, opt, accum):
    key = (model, opt, accum)
    if key not in _reference:
        path = tmp_path_factory.mktemp("single") / "summary.json"
        run_single(_args(model, opt, accum, path))
        _reference[key] = json.loads(path.read_text())
    return _reference[key]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_zero_matches_single(tmp_path_factory, tmp_path, case):
    world, strategy, model, opt, accum = case
    ref = _single(tmp_path_factory, model, opt, accum)
    path = tmp_path / "zero.json"
    run_mpi(world, _args(model, opt, accum, path) + ["--strategy", strategy], timeout=240)
    got = json.loads(path.read_text())
    assert got["world_size"] == world and got["strategy"] == strategy
    assert len(got["losses"]) == 20
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    np.testing.assert_allclose(got["buffer_norm"], ref["buffer_norm"], rtol=1e-5)
