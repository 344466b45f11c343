"""The MPI world under a real mpirun, with and without pretend nodes."""

import os

import pytest

from hpctrain.runtime.world import mpi_yield_default, ranks_per_node_override
from tests.mpirun import run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.mpi
@pytest.mark.parametrize("n, per_node", [(1, None), (2, None), (4, None), (4, "2"), (4, "1")])
def test_world_layout(n, per_node):
    env = {"HPCTRAIN_RANKS_PER_NODE": per_node} if per_node else None
    proc = run_mpi(n, [os.path.join(HERE, "world_worker.py")], env=env, timeout=120)
    nodes = n // int(per_node) if per_node else 1
    assert f"ranks={n} nodes={nodes}" in proc.stdout


def test_ranks_per_node_override_parsing():
    assert ranks_per_node_override({}, 0) == 0
    assert ranks_per_node_override({"HPCTRAIN_RANKS_PER_NODE": "2"}, 0) == 2
    assert ranks_per_node_override({"HPCTRAIN_RANKS_PER_NODE": "2"}, 3) == 3
    with pytest.raises(ValueError, match="not a positive integer"):
        ranks_per_node_override({"HPCTRAIN_RANKS_PER_NODE": "two"})
    with pytest.raises(ValueError, match="not a positive integer"):
        ranks_per_node_override({"HPCTRAIN_RANKS_PER_NODE": "0"})


def test_a_launcher_whose_ranks_mpi_does_not_see_is_refused():
    from hpctrain.errors import UsageError
    from hpctrain.runtime.launcher import LaunchInfo
    from hpctrain.runtime.world import check_launch_size

    torchrun = LaunchInfo("torchrun", 1, 2, 1, 2, 0, 1, None)
    with pytest.raises(UsageError, match="torchrun launcher started 2 processes, but MPI sees 1"
                       ) as err:
        check_launch_size(torchrun, 1)
    assert "mpirun -n N or srun --mpi=pmix" in str(err.value)
    slurm = LaunchInfo("slurm", 0, 2, 0, 2, 0, 1, "7")
    with pytest.raises(UsageError, match="srun --mpi=pmix"):
        check_launch_size(slurm, 1)
    check_launch_size(slurm, 2)
    check_launch_size(LaunchInfo("single", 0, 1, 0, 1, 0, 1, None), 4)  # MPI knows better


def test_mpi_yields_when_the_node_has_no_spare_core():
    two = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert mpi_yield_default(two, cores=2) == "1"
    assert mpi_yield_default(two, cores=16) is None
    assert mpi_yield_default({**two, "OMPI_MCA_mpi_yield_when_idle": "0"}, cores=2) is None
    assert mpi_yield_default({}, cores=1) is None  # not Open MPI's mpirun: leave it alone
