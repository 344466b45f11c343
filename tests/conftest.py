"""Session-wide: which modules' train steps the shared launches run (tests/parallel/train_cases),
and MPI ranks that yield their core while they wait."""

import os

import pytest

from tests.parallel import train_cases

# Every job the tests start (mpirun, and srun/sbatch/PBS jobs, which inherit the environment)
# runs more ranks than this machine has cores: waiting ranks yield instead of spinning
# (tests/mpirun.py mpi_env says the same for the launches it builds).
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    train_cases.select_pooled(items)
