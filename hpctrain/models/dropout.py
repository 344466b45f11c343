"""Dropout whose mask does not depend on how the activation is split over ranks.

The mask is drawn for the WHOLE activation from torch's RNG and this rank keeps its slice,
so a model-parallel rank holding some heads (tensor parallel) or a sequence chunk (sequence
parallel) applies exactly the mask one process would: the tensor-parallel ranks of a replica
draw the same numbers in the same order, as their RNG states stay equal. Megatron keeps a
separate model-parallel RNG state per rank instead, which trains correctly but not like one
process; drawing the whole mask costs tp times the random numbers of the slice.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Dropout"]


class Dropout(nn.Module):
    """nn.Dropout with split-invariant masks. ``shards``: ((dim, index, count), ...) set by a
    model-parallel transform: along ``dim`` the local activation is chunk ``index`` of
    ``count`` equal chunks of the whole one."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must be in [0, 1)")
        self.p = float(p)
        self.shards: tuple = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        for dim, _, count in self.shards:
            shape[dim] *= count
        keep = torch.rand(shape, device=x.device) >= self.p  # fp32 draws under any autocast
        for dim, index, _ in self.shards:
            n = x.shape[dim]
            keep = keep.narrow(dim, index * n, n)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}" + (f", shards={self.shards}" if self.shards else "")
