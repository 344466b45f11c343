"""One process, one device: the reference every other strategy must reproduce."""

from __future__ import annotations

from torch import nn

from hpctrain.parallel.base import OptimizerFactory, Parallelized

__all__ = ["wrap"]


class SingleProcess(Parallelized):
    name = "single"


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world, options=None) -> Parallelized:
    """Move the model to this rank's device and build its optimizer; no communication."""
    model.to(world.device)
    return SingleProcess(model, make_optimizer(model.parameters()))
