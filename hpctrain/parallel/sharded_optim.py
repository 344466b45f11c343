"""Keep shard elements still whose parameters got no gradient anywhere this step.

Single-process optimizers skip a parameter whose ``.grad`` is None; a flat shard always has
a gradient (zeros there), and weight decay or momentum would still move those elements.
Shared by the sharded strategies.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["preserve_elements"]


@contextlib.contextmanager
def preserve_elements(optimizer: torch.optim.Optimizer, ranges: dict):
    """Restore ``ranges`` ({shard parameter: [(a, b), ...]}) of each shard and of its
    shard-shaped optimizer state to their values before the block (a local call)."""
    saved = []
    for shard, spans in ranges.items():
        if not spans:
            continue
        state = optimizer.state.get(shard, {})
        # State created by this very step starts at zero for zero-gradient elements already.
        tensors = [shard.detach()] + [v for v in state.values()
                                      if torch.is_tensor(v) and v.shape == shard.shape]
        saved += [(t, a, b, t[a:b].clone()) for t in tensors for a, b in spans]
    yield
    with torch.no_grad():
        for t, a, b, old in saved:
            t[a:b].copy_(old)
