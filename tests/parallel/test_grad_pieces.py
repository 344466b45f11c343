"""The sharded engine's piecewise gradient reduce-scatter, under mpirun at 2 and 4 ranks."""

import os

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_gets_its_slice_of_the_summed_gradients(n):
    run_mpi(n, [os.path.join(HERE, "grad_pieces_worker.py")], timeout=180)
