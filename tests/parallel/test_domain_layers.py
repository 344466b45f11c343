"""Domain-parallel layers vs the unsharded torch layers, forward and backward, under mpirun."""

import os

import pytest

from tests.mpirun import run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_domain_layers_match_torch(n):
    proc = run_mpi(n, [os.path.join(HERE, "domain_layers_worker.py")], timeout=400)
    assert "domain layers ok:" in proc.stdout and f"on {n} ranks" in proc.stdout, proc.stdout
