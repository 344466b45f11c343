"""Under mpirun: each mesh sub-communicator holds exactly the ranks that differ along its dim.

``mesh_worker.py LAYOUT...`` checks every layout in turn (none: the default ""), one process
start for all of them; each prints "mesh ok LAYOUT RANK COORDS" once it holds on this rank."""

import sys

import torch

from hpctrain.runtime.world import init_world
from hpctrain.runtime.mesh import DIMS

world = init_world()
for layout in sys.argv[1:] or [""]:
    mesh = world.mesh(layout)
    for dim in DIMS:
        c = mesh.comm(dim)
        assert c.size == mesh.size(dim), (layout, dim, c.size, mesh.size(dim))
        assert c.rank == mesh.coords[dim], (layout, dim, c.rank, mesh.coords)
        # Gather the world ranks in this group: exactly this rank with dim varied.
        got = c.allgather(torch.tensor([world.rank], dtype=torch.int64)).tolist()
        want = [mesh._rank_of({**mesh.coords, dim: i}) for i in range(mesh.size(dim))]
        assert got == want, (layout, dim, got, want)
    sys.stdout.write(f"mesh ok {layout!r} {world.rank} {mesh.coords}\n")  # one write per line
    sys.stdout.flush()
