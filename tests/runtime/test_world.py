"""The MPI world under a real mpirun, with and without pretend nodes."""

import os

import pytest

from hpctrain.runtime.world import ranks_per_node_override
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
