"""Activation checkpointing: recompute each block's activations during backward."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks", "find_blocks"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """Return the repeated blocks: elements of every nn.ModuleList, else the top-level children."""
    blocks = [m for ml in model.modules() if isinstance(ml, nn.ModuleList) for m in ml]
    return blocks or list(model.children())


def checkpoint_blocks(model: nn.Module) -> int:
    """Make each block recompute its activations in backward; return how many were wrapped.

    The forward is replaced on the instance, not by wrapping the module, so parameter names
    (and therefore checkpoints and gradient-reduction names) do not change.
    """
    blocks = find_blocks(model)
    for block in blocks:
        if getattr(block, "_hpctrain_checkpointed", False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args, _original=original, **kwargs):
            # Non-reentrant: works with kwargs, unused outputs and parameters without grads.
            return checkpoint(_original, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._hpctrain_checkpointed = True
    return len(blocks)
