"""Data parallel with Horovod: replicated model, gradients all-reduced during backward.

Horovod runs on the job's MPI communicator (``hvd.init(comm=...)``), so it sees exactly
the ranks mpi4py sees. Gradients are SUMMED, not averaged: the training loop weights each
micro-batch loss by its share of the global batch, which makes the result independent of
the world size even when the batch does not split evenly over ranks.
"""

from __future__ import annotations

import os
import torch
from torch import nn

from hpctrain.errors import UsageError
from hpctrain.parallel.base import DPGroups, OptimizerFactory, Parallelized
from hpctrain.parallel.ddp_options import DDPOptions
from hpctrain.parallel.placement import Copies
from hpctrain.parallel.sync_batchnorm import convert_sync_batchnorm
from hpctrain.runtime.flight import RECORDER, group_key

__all__ = ["DDPOptions", "wrap"]


def _init_horovod(mpi_comm, opts: DDPOptions):
    """Start Horovod on the job's MPI communicator (once per process)."""
    import horovod.torch as hvd

    if hvd.is_initialized():
        return hvd
    # Fusion and cycle time are read from the environment at init time only.
    os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(opts.fusion_threshold_mb * 1024 * 1024))
    os.environ["HOROVOD_CYCLE_TIME"] = str(opts.cycle_time_ms)
    hvd.init(comm=mpi_comm)
    if not hvd.mpi_enabled():
        raise RuntimeError("Horovod started without its MPI controller; rebuild it with "
                           "HOROVOD_WITH_MPI=1 (make setup does)")
    return hvd


class HorovodDDP(Parallelized):
    name = "ddp"

    def __init__(self, model, optimizer, hvd, host_comm):
        super().__init__(model, optimizer, host_comm)
        self._hvd = hvd
        self._host = host_comm
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        key = group_key(host_comm)  # Horovod reduces over these ranks: the dp group
        self._flight_group = "dp" + key[key.index("["):]

    def _sync_grads(self) -> None:
        # Horovod fills a missing gradient with zeros before reducing it; a parameter that
        # got no gradient on ANY rank must stay gradient-less, or weight decay and Adam's
        # moments would move it where single-process training does not.
        had = torch.tensor([p.grad is not None for p in self._trainable], dtype=torch.uint8)
        if len(had):
            self._host.allreduce(had, op="max")
        # Horovod's allreduces start in backward hooks; synchronize waits for them all:
        # recorded as one op over dp so the watchdog sees a stall inside Horovod too.
        nbytes = sum(p.numel() * p.element_size() for p in self._trainable)
        with RECORDER.op(self._flight_group, "hvd.allreduce", nbytes, "float32"):
            self.optimizer.synchronize()
        for p, flag in zip(self._trainable, had.tolist()):
            if not flag:
                p.grad = None

    def _optimizer_step(self, scaler) -> None:
        with self.optimizer.skip_synchronize():
            super()._optimizer_step(scaler)


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world, options: DDPOptions | None = None,
         groups: DPGroups | None = None) -> Parallelized:
    """Replicate model over the dp replicas with Horovod (collective over the world).

    Horovod reduces over the communicator it was started on, the whole job: ``groups`` (from
    the orchestrator) must sum gradients over every rank (dp times any partial groups, e.g.
    the tiles of a domain split)."""
    opts = options or DDPOptions()
    groups = groups or DPGroups.of_world(world)
    if groups.sum_size != world.size:
        raise UsageError(f"the ddp flavour (Horovod) sums gradients over all {world.size} ranks, "
                         f"but this plan sums them over {groups.sum_size}; use --dp-flavour "
                         f"zero1/zero2 for it")
    if world.device.type != "cpu" and not _gpu_ops_built():
        raise RuntimeError("Horovod was built without GPU operations; rebuild with "
                           "HOROVOD_GPU_OPERATIONS=NCCL (make setup with CUDA loaded)")
    hvd = _init_horovod(world.mpi_comm, opts)
    model.to(world.device)
    if opts.sync_batchnorm:  # batch statistics of the global batch, as in one process
        model = convert_sync_batchnorm(model, groups.batch)
    # Parameters AND buffers from rank 0, so a user model with random init still agrees.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = make_optimizer(model.parameters())
    # Horovod's broadcast_optimizer_state initialises empty state by taking a zero-gradient
    # step, which applies weight decay and advances Adam's step count; a fresh optimizer over
    # identical parameters is identical on every rank, so only broadcast real state.
    if optimizer.state_dict()["state"]:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if opts.fp16_compression else hvd.Compression.none
    dopt = hvd.DistributedOptimizer(
        optimizer, named_parameters=list(model.named_parameters()), compression=compression,
        backward_passes_per_step=opts.grad_accum, op=hvd.Sum)
    par = HorovodDDP(model, dopt, hvd, world.host)
    par.dp_copies = (Copies("dp", groups.dp),)
    return par


def _gpu_ops_built() -> bool:
    import horovod.torch as hvd

    return bool(hvd.nccl_built())
