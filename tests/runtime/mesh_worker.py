"""Under mpirun: each mesh sub-communicator holds exactly the ranks that differ along its dim."""

import sys

import torch

from hpctrain.runtime.world import init_world
from hpctrain.runtime.mesh import DIMS

world = init_world()
mesh = world.mesh(sys.argv[1] if len(sys.argv) > 1 else "")
for dim in DIMS:
    c = mesh.comm(dim)
    assert c.size == mesh.size(dim), (dim, c.size, mesh.size(dim))
    assert c.rank == mesh.coords[dim], (dim, c.rank, mesh.coords)
    # Gather the world ranks in this group: they must be exactly this rank with dim varied.
    got = c.allgather(torch.tensor([world.rank], dtype=torch.int64)).tolist()
    want = [mesh._rank_of({**mesh.coords, dim: i}) for i in range(mesh.size(dim))]
    assert got == want, (dim, got, want)
print("mesh ok", world.rank, mesh.coords)
