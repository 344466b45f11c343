"""Under mpirun: world ranks, node and cross-node communicators, ranks-per-node override."""

import os

import torch

from hpctrain.runtime.world import init_world

world = init_world()
per_node = int(os.environ.get("HPCTRAIN_RANKS_PER_NODE", "0")) or world.size  # one real node here
assert world.local_size == per_node, (world.local_size, per_node)
assert world.local_rank == world.rank % per_node
assert world.num_nodes == world.size // per_node
assert world.node_rank == world.rank // per_node
assert world.launch.launcher == "openmpi" and world.launch.rank == world.rank
assert world.device.type == "cpu" and torch.get_num_threads() == 1
# node comm holds the ranks of this (pretend) node, cross comm one rank per node
members = world.node.allgather(torch.tensor([world.rank])).tolist()
assert members == list(range(world.node_rank * per_node, (world.node_rank + 1) * per_node)), members
peers = world.cross.allgather(torch.tensor([world.rank])).tolist()
assert peers == [n * per_node + world.local_rank for n in range(world.num_nodes)], peers
if world.is_main:
    print(world.describe(strategy="ddp"))
