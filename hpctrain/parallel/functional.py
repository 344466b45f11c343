"""Differentiable collectives: each forward has its exact adjoint as backward.

Shared by strategies (they must not import each other). Every function here is checked
by tests/adjoint.py: <F x, y> = <x, F* y> summed over the ranks.
"""

from __future__ import annotations

import torch

from hpctrain.runtime.comm import Communicator

__all__ = ["all_reduce_sum"]


class _AllReduceSum(torch.autograd.Function):
    """y_r = sum_q x_q on every rank r; the adjoint is the same all-reduce of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return comm.allreduce(x.detach().clone().contiguous(), op="sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.allreduce(grad.detach().clone().contiguous(), op="sum"), None


def all_reduce_sum(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum x over the ranks of comm, differentiably (collective over comm)."""
    if comm.size == 1:
        return x
    return _AllReduceSum.apply(x, comm)
