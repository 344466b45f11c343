"""One adjoint check for every distributed linear operator: <F x, y> = <x, F* y> over all ranks."""

import torch

__all__ = ["check_adjoint"]


def check_adjoint(forward, x_shape, y_shape, comm, dtype=torch.float64, rtol=1e-10, seed=0):
    """Check that the autograd backward of ``forward`` is its exact adjoint (collective).

    x and y are random on every rank; F* y is obtained by backpropagating y through F.
    """
    g = torch.Generator().manual_seed(seed + 7919 * comm.rank)
    x = torch.randn(x_shape, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randn(y_shape, generator=g, dtype=dtype)
    fx = forward(x)
    (adj,) = torch.autograd.grad(fx, x, grad_outputs=y)
    lhs, rhs = comm.allreduce_scalars([float((fx.detach() * y).sum()), float((x.detach() * adj).sum())])
    if abs(lhs - rhs) > rtol * max(abs(lhs), abs(rhs), 1e-30):
        raise AssertionError(f"adjoint mismatch: <Fx,y>={lhs!r} <x,F*y>={rhs!r}")
    return lhs, rhs
