"""A bench layer whose cost is fixed in wall-clock time, not in work.

On a shared or throttled host the cores run at different, drifting speeds, so layers with
equal FLOPs make unequal pipeline stages. A timed layer busy-waits a set time instead: its
stages are equal by construction whatever each core's speed. It spins (holding the core, as
real compute does) rather than sleeping, so contention for a core still shows. It carries
real tensors (y = x * scale, one trainable scale per feature) so activations, gradients and
the optimizer step are the same size and kind as a Linear layer's of that width.
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = ["spin_until", "TimedLayer"]


def spin_until(deadline: float) -> None:
    """Busy-wait until time.perf_counter() reaches ``deadline`` (a sleep would free the core)."""
    while time.perf_counter() < deadline:
        pass


class _Timed(torch.autograd.Function):
    """y = x * scale; forward takes ``seconds``, backward 2 * ``seconds`` (two products, as
    a real layer's backward computes the input and the weight gradient). The arithmetic runs
    first and the spin fills the rest of the time, so its cost (which does vary with the
    core's speed) is inside the fixed time rather than added to it."""

    @staticmethod
    def forward(ctx, x, scale, seconds):
        t0 = time.perf_counter()
        ctx.save_for_backward(x, scale)
        ctx.seconds = seconds
        y = x * scale
        spin_until(t0 + seconds)
        return y

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        x, scale = ctx.saved_tensors
        gx, gs = grad * scale, (grad * x).reshape(-1, scale.numel()).sum(0)
        spin_until(t0 + 2 * ctx.seconds)
        return gx, gs, None


class TimedLayer(nn.Module):
    """``width`` features, ``seconds`` forward and 2 * ``seconds`` backward per call."""

    def __init__(self, width: int, seconds: float):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.seconds = seconds

    def forward(self, x):
        return _Timed.apply(x, self.scale, self.seconds)

    def extra_repr(self) -> str:
        return f"width={self.scale.numel()}, fwd={self.seconds * 1e3:.2f} ms"

