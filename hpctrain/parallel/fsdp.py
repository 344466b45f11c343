"""Fully sharded data parallel, hand-written over the Communicator (no torch FSDP inside).

The model is cut into units by an auto-wrap policy (repeated blocks, module classes, or a
minimum parameter count); each unit is one flat padded buffer (``FlatUnit``) sharded over a
group of ranks. Sharding strategies:

- FULL_SHARD: parameters, gradients and optimizer state sharded over all ranks; a unit is
  gathered before its forward, freed after it, re-gathered before its backward (zero3).
- SHARD_GRAD_OP: as FULL_SHARD, but a unit gathered for forward stays until its backward is
  over (no second all-gather); gradients and optimizer state sharded.
- NO_SHARD: full replicas; gradients all-reduced over the ranks (DDP over our comm).
- HYBRID_SHARD: FULL_SHARD inside a node (the runtime's node communicator), replicated
  across nodes: gradients reduce-scattered in the node, then all-reduced across nodes.

Mixed precision: the gathered parameters (what the model computes with) are ``param_dtype``
while the shards keep fp32 masters that the optimizer steps; gradients are reduced in
``reduce_dtype``; floating buffers are cast to ``buffer_dtype``. CPU offload keeps the
shards, their gradients and the optimizer state on the host (GPU runs only).
"""

from __future__ import annotations

import torch
from torch import nn

from hpctrain.parallel.base import DPGroups, OptimizerFactory, Parallelized
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.sharding.engine import ShardedModel, ShardPlan, prepare_model
from hpctrain.parallel.sharding.schedule import GatherSchedule, cast_floating_inputs
from hpctrain.parallel.sharding.solo import SoloCommunicator
from hpctrain.parallel.fsdp_options import (BACKWARD_PREFETCH, DEFAULT_ALLGATHER_BUCKET_BYTES,
                                             SHARDING_STRATEGIES, FSDPOptions)
from hpctrain.parallel.units import WRAP_POLICIES, wrapped_modules

__all__ = ["FSDPOptions", "SHARDING_STRATEGIES", "WRAP_POLICIES", "BACKWARD_PREFETCH",
           "DTYPES", "DEFAULT_ALLGATHER_BUCKET_BYTES", "wrap", "wrapped_modules"]

DTYPES = {"": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3}


def _groups(world, strategy: str, dp):
    """(shard communicator, replicate communicator or None) over the dp replicas ``dp``."""
    if strategy == "FULL_SHARD" or strategy == "SHARD_GRAD_OP" or dp.size == 1:
        return dp, None
    if strategy == "NO_SHARD":
        return SoloCommunicator(dp.device), dp
    # HYBRID_SHARD: shard over the replicas on this node, replicate across nodes.
    if dp is world.comm and world.comm is world.host:
        return world.node, world.cross  # the runtime's (every rank a replica)
    node = dp.split(world.node_rank, key=dp.rank, name="dp.node")
    cross = dp.split(node.rank, key=dp.rank, name="dp.cross")
    return node, cross


class FSDP(ShardedModel):
    """A model sharded by fsdp (the engine does the work)."""

    def __init__(self, model, make_optimizer, world, units, frozen, opts: FSDPOptions,
                 shard_comm, replicate_comm, schedule, groups: DPGroups, on_demand: bool,
                 specs=None, external: bool = False, name_of=None):
        self.opts = opts
        plan = ShardPlan(name="fsdp", stage=_STAGE[opts.sharding_strategy],
                         grad_accum=opts.grad_accum, on_demand=on_demand,
                         reduce_dtype=DTYPES[opts.reduce_dtype], hook_reduce=not external,
                         reduce_bucket_size=opts.reduce_bucket_size)
        super().__init__(model, make_optimizer, world, units, frozen, plan, shard_comm,
                         replicate_comm, schedule, name_of=name_of)
        self.reshard_after_forward = opts.sharding_strategy != "SHARD_GRAD_OP"


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world,
         options: FSDPOptions | None = None, groups: DPGroups | None = None, units=None,
         name_of=None) -> Parallelized:
    """Shard model and optimizer with fsdp over the dp replicas (``groups``: from the
    orchestrator; default every rank a replica). Collective over the world. ``units`` and
    ``name_of``: as zero.wrap (a model-parallel transform's units, driven by its executor)."""
    opts = options or FSDPOptions()
    groups = groups or DPGroups.of_world(world)
    external = units is not None
    model, specs, frozen = prepare_model(model, world, opts, groups, units)
    shard_comm, replicate_comm = _groups(world, opts.sharding_strategy, groups.dp)
    param_dtype = DTYPES[opts.param_dtype]
    offload = opts.cpu_offload and world.device.type != "cpu"
    if opts.cpu_offload and not offload and world.rank == 0:
        print("hpctrain: fsdp cpu_offload is a no-op on CPU ranks (everything is on the host)",
              flush=True)
    mixed = any(param_dtype not in (None, p.dtype) for s in specs for _, p in s.params)
    sharded = opts.sharding_strategy != "NO_SHARD" and shard_comm.size > 1
    keep_full = not sharded and not mixed and not offload
    units = [FlatUnit(s.name, s.params, shard_comm, keep_full=keep_full,
                      compute_dtype=param_dtype, shard_device="cpu" if offload else None)
             for s in specs]
    schedule = None
    if sharded and not external:
        schedule = GatherSchedule(specs, units,
                                  reshard_after_forward=opts.sharding_strategy != "SHARD_GRAD_OP",
                                  prefetch=opts.backward_prefetch == "BACKWARD_PRE",
                                  root=model, prefetch_bytes=opts.allgather_bucket_size)
    elif sharded:
        for u in units:  # the executor gathers each unit when its layers run
            u.free()
    elif not keep_full:  # unsharded with a cast or an offload: gathered once, for good
        for u in units:
            u.gather()
    buffer_dtype = DTYPES[opts.buffer_dtype]
    if buffer_dtype is not None:
        for b in model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(buffer_dtype)
    if param_dtype is not None:
        cast_floating_inputs(model, param_dtype)
    return FSDP(model, make_optimizer, world, units, frozen, opts, shard_comm, replicate_comm,
                schedule, groups, sharded, specs, external, name_of)

