"""One process, one device: the reference every other strategy must reproduce."""

from __future__ import annotations

from torch import nn

from hpctrain.errors import UsageError
from hpctrain.parallel.base import OptimizerFactory, Parallelized

__all__ = ["wrap"]


class SingleProcess(Parallelized):
    name = "single"


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world, options=None) -> Parallelized:
    """Move the model to this rank's device and build its optimizer; no communication."""
    if world.size > 1:
        raise UsageError(f"strategy 'single' on {world.size} ranks: each rank would train its "
                         "own copy of the model and the copies would diverge; use strategy "
                         "'ddp' (or another parallel strategy), or launch one process")
    model.to(world.device)
    return SingleProcess(model, make_optimizer(model.parameters()), world.host)
