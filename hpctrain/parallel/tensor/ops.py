"""The communication of tensor parallelism as autograd Functions with exact adjoints.

Megatron-LM's conjugate pairs, over our Communicator (the tp group):

- ``copy_to``: identity forward, all-reduce backward (the input of a column-parallel layer:
  every tp rank reads the whole activation, each contributes a partial gradient);
- ``reduce_from``: all-reduce forward, identity backward (the output of a row-parallel layer);

and the sequence-parallel pair (Korthikanti et al. 2022), the same bytes split in two:

- ``gather_seq``: all-gather along the sequence dim forward, reduce-scatter backward;
- ``reduce_scatter_seq``: reduce-scatter along the sequence dim forward, all-gather backward;
- ``split_seq``: this rank's sequence chunk forward, zero-padded gradient backward (no
  communication: the gradient of a replicated input is then partial over tp).

The sequence dim is -2 (activations are (..., sequence, hidden) in batch-first models).
"""

from __future__ import annotations

import torch

__all__ = ["SEQ_DIM", "copy_to", "reduce_from", "gather_seq", "reduce_scatter_seq",
           "split_seq", "seq_chunk"]

SEQ_DIM = -2


def _allgather(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """Concatenate every rank's x along dim (collective)."""
    moved = x.movedim(dim, 0).contiguous()
    out = comm.allgather(moved)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    """Sum x over the ranks and keep this rank's chunk along dim (collective)."""
    n = x.shape[dim]
    if n % comm.size:
        raise ValueError(f"sequence parallel: dim {dim} of size {n} does not split over "
                         f"tp={comm.size}; use a sequence length divisible by tp")
    moved = x.movedim(dim, 0).contiguous()
    out = comm.reduce_scatter(moved)
    return out.movedim(0, dim).contiguous()


def seq_chunk(x: torch.Tensor, comm, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's chunk of x along dim (a view; no communication)."""
    n = x.shape[dim]
    if n % comm.size:
        raise ValueError(f"sequence parallel: sequence length {n} does not split over "
                         f"tp={comm.size}; use a sequence length divisible by tp")
    k = n // comm.size
    return x.narrow(dim, comm.rank * k, k)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.comm.allreduce(g.contiguous().clone()), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return comm.allreduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _allgather(x, comm, dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.comm, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim)

    @staticmethod
    def backward(ctx, g):
        return _allgather(g, ctx.comm, ctx.dim), None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim, ctx.shape = comm, dim, x.shape
        return seq_chunk(x, comm, dim).contiguous()

    @staticmethod
    def backward(ctx, g):
        full = g.new_zeros(ctx.shape)
        seq_chunk(full, ctx.comm, ctx.dim).copy_(g)
        return full, None, None


def copy_to(x: torch.Tensor, comm) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient over comm backward."""
    return x if comm.size == 1 else _CopyTo.apply(x, comm)


def reduce_from(x: torch.Tensor, comm) -> torch.Tensor:
    """All-reduce over comm forward, identity backward."""
    return x if comm.size == 1 else _ReduceFrom.apply(x, comm)


def gather_seq(x: torch.Tensor, comm, dim: int = SEQ_DIM) -> torch.Tensor:
    """All-gather of the sequence chunks forward, reduce-scatter of the gradient backward."""
    return x if comm.size == 1 else _GatherSeq.apply(x, comm, dim)


def reduce_scatter_seq(x: torch.Tensor, comm, dim: int = SEQ_DIM) -> torch.Tensor:
    """Reduce-scatter into sequence chunks forward, all-gather of the gradient backward."""
    return x if comm.size == 1 else _ReduceScatterSeq.apply(x, comm, dim)


def split_seq(x: torch.Tensor, comm, dim: int = SEQ_DIM) -> torch.Tensor:
    """This rank's sequence chunk forward; backward, its gradient in place, zeros elsewhere."""
    return x if comm.size == 1 else _SplitSeq.apply(x, comm, dim)
