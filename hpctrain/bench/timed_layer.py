"""A bench layer whose cost is fixed in wall-clock time, not in work.

On a shared or throttled host the cores run at different, drifting speeds, so layers with
equal FLOPs make unequal pipeline stages. A timed layer busy-waits a set time instead: its
stages are equal by construction whatever each core's speed. It spins (holding the core, as
real compute does) rather than sleeping, so contention for a core still shows; with
``sleep=True`` it sleeps instead, as a host whose stage computes on a GPU leaves its core
idle, so more stages than cores can still run side by side. It carries
real tensors (y = x * scale, one trainable scale per feature) so activations, gradients and
the optimizer step are the same size and kind as a Linear layer's of that width.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["spin_until", "wait_until", "TimedLayer", "TailClock", "timed_mse_loss"]

_SPIN_TAIL = 3e-4  # a sleep wakes up late by up to this: spin the last part for precision


def spin_until(deadline: float) -> None:
    """Busy-wait until time.perf_counter() reaches ``deadline`` (a sleep would free the core)."""
    while time.perf_counter() < deadline:
        pass


def wait_until(deadline: float, sleep: bool = False) -> None:
    """Spin until ``deadline``; with ``sleep``, sleep until just before it and spin the rest."""
    if sleep:
        rest = deadline - time.perf_counter() - _SPIN_TAIL
        if rest > 0:
            time.sleep(rest)
    spin_until(deadline)


class _Timed(torch.autograd.Function):
    """y = x * scale; forward takes ``seconds``, backward 2 * ``seconds`` (two products, as
    a real layer's backward computes the input and the weight gradient). The arithmetic runs
    first and the spin fills the rest of the time, so its cost (which does vary with the
    core's speed) is inside the fixed time rather than added to it."""

    @staticmethod
    def forward(ctx, x, scale, seconds, tail, sleep):
        t0 = time.perf_counter()
        ctx.save_for_backward(x, scale)
        ctx.seconds, ctx.tail, ctx.sleep = seconds, tail, sleep
        y = x * scale
        if tail is None:
            wait_until(t0 + seconds, sleep)
        else:  # the loss that follows waits out the rest of this layer's time
            tail.forward_start = t0
        return y

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        x, scale = ctx.saved_tensors
        gx, gs = grad * scale, (grad * x).reshape(-1, scale.numel()).sum(0)
        tail = ctx.tail
        if tail is not None and tail.backward_start is not None:
            t0, tail.backward_start = tail.backward_start, None  # the loss's backward began it
        wait_until(t0 + 2 * ctx.seconds, ctx.sleep)
        return gx, gs, None, None, None


class TailClock:
    """Shared by a timed model's last layer and its loss (timed_mse_loss), so the two take
    the layer's fixed time together: the last stage, which alone computes the loss, then
    costs what every other stage costs. A real model balances its loss the same way, by
    giving the last stage less work (pipeline.balance = 'measured' times the loss too)."""

    def __init__(self, sleep: bool = False):
        self.sleep = sleep          # how the loss waits (as the layers do)
        self.forward_start = None   # set by the last layer's forward
        self.backward_start = None  # set by the loss's backward


class _LossTail(torch.autograd.Function):
    """Identity on a loss: its forward waits out the time its TailClock's layer began; its
    backward, the first of the backward pass, starts the clock of that layer's backward."""

    @staticmethod
    def forward(ctx, loss, seconds, clock):
        ctx.clock = clock
        if clock.forward_start is not None:
            wait_until(clock.forward_start + seconds, clock.sleep)
            clock.forward_start = None
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.backward_start = time.perf_counter()
        return grad, None, None


def timed_mse_loss(clock: TailClock, seconds: float):
    """The MSE loss of a timed model whose last layer was built with ``tail=clock``."""
    def loss(out, target):
        return _LossTail.apply(F.mse_loss(out, target), seconds, clock)
    return loss


class TimedLayer(nn.Module):
    """``width`` features, ``seconds`` forward and 2 * ``seconds`` backward per call, spent
    spinning (or sleeping, ``sleep``); with ``tail`` (a TailClock), those times include the
    loss computed on its output."""

    def __init__(self, width: int, seconds: float, tail: TailClock | None = None,
                 sleep: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.seconds = seconds
        self.tail = tail
        self.sleep = sleep

    def forward(self, x):
        return _Timed.apply(x, self.scale, self.seconds, self.tail, self.sleep)

    def extra_repr(self) -> str:
        return (f"width={self.scale.numel()}, fwd={self.seconds * 1e3:.2f} ms"
                + (", sleeps" if self.sleep else ""))

