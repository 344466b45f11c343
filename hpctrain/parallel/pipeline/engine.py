"""Run one rank's schedule: forwards and backwards of its chunks over micro-batches."""

from __future__ import annotations

import time

import torch
from torch.utils.checkpoint import checkpoint

from hpctrain.parallel.pipeline.p2p import StageLinks
from hpctrain.parallel.pipeline.schedule import Action, stage_of

__all__ = ["Engine"]


class Engine:
    """Executes Actions for the chunks of one rank.

    ``chunks[c]`` is the list of PipeLayers of local chunk c; their modules live under
    ``root``. ``trace`` (when a list) receives (op, mb, chunk, start, end) of every compute,
    which the bench turns into measured bubble fractions.
    """

    def __init__(self, root, chunks, links: StageLinks, rank: int, p: int,
                 activation_checkpointing: bool = False):
        self.root = root
        self.chunks = chunks
        self.links = links
        self.rank, self.p = rank, p
        self.v = len(chunks)
        self.S = p * self.v
        self.recompute = activation_checkpointing
        self.trace: list | None = None
        self.peak_live = 0
        self.after_backward = None  # called with the action's index after each backward

    def _forward_chunk(self, c: int, x):
        for layer in self.chunks[c]:
            if self.recompute:
                x = checkpoint(layer.forward, self.root, x, use_reentrant=False)
            else:
                x = layer.forward(self.root, x)
        return x

    def run(self, actions: list[Action], micro: list, loss_fn, precision) -> float:
        """Run ``actions`` over ``micro`` = [(x, y, weight)]; return the weighted loss sum
        (nonzero on the rank of the last stage only)."""
        live: dict = {}   # (mb, chunk) -> (input, output or scaled loss)
        loss_sum = 0.0
        for i, a in enumerate(actions):
            g = stage_of(self.rank, a.chunk, self.p)
            if a.op == "F":
                x, y, w = micro[a.mb]
                inp = x if g == 0 else self.links.recv_activation(g - 1)
                if g > 0 and inp.is_floating_point():
                    inp.requires_grad_(True)
                t0 = time.perf_counter()
                with precision.autocast():
                    out = self._forward_chunk(a.chunk, inp)
                    if g == self.S - 1:
                        loss = loss_fn(out, y)
                if g == self.S - 1:
                    loss_sum += float(loss.detach()) * w
                    out = precision.scale(loss * w)
                else:
                    self.links.send_activation(g, out, a.mb)
                live[(a.mb, a.chunk)] = (inp, out)
                self.peak_live = max(self.peak_live, len(live))
            else:
                inp, out = live.pop((a.mb, a.chunk))
                grad = None if g == self.S - 1 else self.links.recv_grad(g)
                t0 = time.perf_counter()
                if out.requires_grad:
                    torch.autograd.backward(out, grad)
                if g > 0 and inp.is_floating_point():
                    self.links.send_grad(g - 1, inp.grad if inp.grad is not None
                                         else torch.zeros_like(inp))
                if self.after_backward is not None:  # e.g. zero2 reduces finished grads
                    self.after_backward(i)
            if self.trace is not None:
                self.trace.append((a.op, a.mb, a.chunk, t0, time.perf_counter()))
        if live:
            raise RuntimeError(f"pipeline schedule left activations of {sorted(live)} without "
                               "a backward; the schedule is incomplete")
        self.links.wait_all()
        return loss_sum
