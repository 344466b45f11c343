"""Differentiable collectives and SyncBatchNorm under a real mpirun."""

import os

import pytest

from tests.mpirun import run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 4])
def test_adjoint_and_sync_batchnorm(n):
    run_mpi(n, [os.path.join(HERE, "functional_worker.py")], timeout=120)
