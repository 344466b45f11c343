"""What every strategy's wrap() returns: a model to call and a step to take."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

__all__ = ["OptimizerFactory", "Parallelized"]

# Strategies build the optimizer themselves (sharded ones over their local shard only).
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Parallelized:
    """A model wrapped by a strategy, with its optimizer.

    The training loop calls ``model(x)``, ``backward(loss)`` once per micro-batch and
    ``step()`` once per optimizer step. Subclasses override the ``_sync_grads`` hook (make
    gradients final) and ``_grad_norm``/``param_norm`` where state is sharded.
    """

    name = "base"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss (already weighted by its share of the global batch)."""
        loss.backward()

    def _sync_grads(self) -> None:
        """Make every gradient the global one (no-op for one process)."""

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads])))

    def _clip(self, max_norm: float) -> float:
        norm = self._grad_norm()
        if math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def _optimizer_step(self, scaler) -> None:
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()

    def step(self, scaler=None, max_grad_norm: float = 0.0) -> None:
        """Finish the gradients, unscale/clip them, step the optimizer and zero the gradients."""
        self._sync_grads()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if max_grad_norm > 0:
            self._clip(max_grad_norm)
        self._optimizer_step(scaler)
        self.optimizer.zero_grad()  # torch >= 2.0 sets grads to None (Horovod takes no args)

    def buffer_norm(self) -> float:
        """Global L2 norm of the floating-point buffers (e.g. BatchNorm running statistics)."""
        with torch.no_grad():
            sq = sum(float(b.detach().double().pow(2).sum()) for b in self.model.buffers()
                     if b.is_floating_point())
        return math.sqrt(sq)

    def param_norm(self) -> float:
        """Global L2 norm of all parameters (each shared parameter counted once)."""
        with torch.no_grad():
            sq = sum(float(p.detach().double().pow(2).sum()) for p in self.model.parameters())
        return math.sqrt(sq)
