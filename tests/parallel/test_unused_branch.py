"""A branch taken on some ranks only (data-dependent unused parameters): zero1 and zero2
reduce every unit in one fixed order, so they neither deadlock nor pair mismatched
collectives, and train exactly as Horovod ddp does on the same ranks. (zero3 and fsdp gather a
unit's parameters when its module runs, so their ranks must run the same modules.)"""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi

ARGS = ["-m", "hpctrain", "train", "--model", "tests.fixtures.branchy:factory", "--steps", "20",
        "--global-batch-size", "4", "--optimizer", "adamw", "--lr", "0.01",
        "--weight-decay", "0.01", "--progress", "off"]


def test_data_dependent_branches_do_not_deadlock_zero1_zero2(tmp_path):
    got = {}
    for flavour in ("ddp", "zero1", "zero2"):
        path = tmp_path / f"{flavour}.json"
        run_mpi(2, ARGS + ["--strategy", flavour, "--summary", str(path),
                           "--out-dir", str(tmp_path / flavour)], timeout=120)
        got[flavour] = json.loads(path.read_text())
    for flavour in ("zero1", "zero2"):
        np.testing.assert_allclose(got[flavour]["losses"], got["ddp"]["losses"], rtol=1e-5)
        np.testing.assert_allclose(got[flavour]["param_norm"], got["ddp"]["param_norm"],
                                   rtol=1e-5)
