"""A reduction over the whole grid of a domain-split tensor, as an autograd Function with its
exact adjoint: the torch function mode makes ``x.sum/mean/amax/amin`` over the spatial dims
(and adaptive pooling to 1) exact with it."""

from __future__ import annotations

import torch

__all__ = ["GridReduce"]


class GridReduce(torch.autograd.Function):
    """y = the sum (mean, max, min) over the whole grid of x's tiles, on every rank.

    Forward reduces the tile partials over the domain group. y is a copy on every rank, each
    copy feeding only that rank's tile, so the adjoint first SUMS the copies' gradients over
    the group, then spreads them as the one-process op does (max: over the grid's ties)."""

    @staticmethod
    def forward(ctx, x, dims, keepdim, op, comm, count):
        if op in ("sum", "mean"):
            y = x.sum(dims, keepdim=True)
            comm.allreduce(y, "sum")
            if op == "mean":
                y = y / count
        else:
            y = (x.amax if op == "amax" else x.amin)(dims, keepdim=True).contiguous()
            comm.allreduce(y, "max" if op == "amax" else "min")
            ctx.save_for_backward(x, y)
        ctx.dims, ctx.keepdim, ctx.op, ctx.comm, ctx.count, ctx.shape = (
            dims, keepdim, op, comm, count, x.shape)
        return y if keepdim else y.squeeze(dims)

    @staticmethod
    def backward(ctx, g):
        if not ctx.keepdim:
            for d in ctx.dims:
                g = g.unsqueeze(d)
        g = ctx.comm.allreduce(g.contiguous().clone(), "sum")
        if ctx.op == "sum":
            gx = g.expand(ctx.shape)
        elif ctx.op == "mean":
            gx = (g / ctx.count).expand(ctx.shape)
        else:
            x, y = ctx.saved_tensors
            hit = (x == y).to(g.dtype)
            n = ctx.comm.allreduce(hit.sum(ctx.dims, keepdim=True).contiguous(), "sum")
            gx = hit * (g / n)
        return gx, None, None, None, None, None
