"""The sharded engine's piecewise gradient reduce-scatter, under mpirun at 2 and 4 ranks (the
worker runs in the session's launches, tests/parallel/train_cases.py)."""

import os

import pytest

from tests.parallel.train_cases import pooled_script

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "grad_pieces_worker.py")
RANKS = (2, 4)

runs = pooled_script(__name__, WORKER, RANKS)


@pytest.mark.parametrize("n", RANKS)
def test_each_rank_gets_its_slice_of_the_summed_gradients(runs, n):
    r = runs[f"n{n}"]  # the worker's assertions abort its launch
    assert r["rc"] == 0 and "grad pieces ok 0" in r["stderr"], r
