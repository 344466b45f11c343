"""Differentiable collectives and SyncBatchNorm under a real mpirun (1, 2 and 4 ranks: the
worker runs in the session's launches, tests/parallel/train_cases.py)."""

import os

import pytest

from tests.parallel.train_cases import pool, pooled_results

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "functional_worker.py")
RANKS = (1, 2, 4)

pool(__name__, lambda tmp: [{"id": f"n{n}", "world": n, "script": WORKER} for n in RANKS],
     "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.mpi
@pytest.mark.parametrize("n", RANKS)
def test_adjoint_and_sync_batchnorm(runs, n):
    r = runs[f"n{n}"]  # the worker's assertions abort its launch
    assert r["rc"] == 0 and "functional ok 0" in r["stdout"], r
