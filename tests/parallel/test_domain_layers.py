"""Domain-parallel layers vs the unsharded torch layers, forward and backward, under mpirun
(2 and 4 ranks: the worker runs in the session's launches, tests/parallel/train_cases.py)."""

import os

import pytest

from tests.parallel.train_cases import pooled_script

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "domain_layers_worker.py")
RANKS = (2, 4)

runs = pooled_script(__name__, WORKER, RANKS)


@pytest.mark.mpi
@pytest.mark.parametrize("n", RANKS)
def test_domain_layers_match_torch(runs, n):
    out = runs[f"n{n}"]["stdout"]  # rank 0's; the worker's assertions abort its launch
    assert "domain layers ok:" in out and f"on {n} ranks" in out, out
