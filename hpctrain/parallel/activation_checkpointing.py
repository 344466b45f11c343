"""Activation checkpointing: recompute each block's activations during backward.

Only blocks are checkpointed (``models.structure.find_blocks``: the one definition the
sharded strategies use for their units too), never a bare BatchNorm or an in-place ReLU
between them; the recompute leaves BatchNorm statistics alone (``models.recompute``).
"""

from __future__ import annotations

import functools
import os

from torch import nn

from hpctrain.models.recompute import checkpoint_without_stat_updates
from hpctrain.models.structure import find_blocks
from hpctrain.runtime.launcher import detect_launcher

__all__ = ["checkpoint_blocks", "disable_kv_cache"]


def _launcher_rank0() -> bool:
    try:
        return detect_launcher(os.environ).rank == 0
    except ValueError:  # a malformed launcher variable is reported where MPI starts
        return True


def disable_kv_cache(model: nn.Module, is_main: bool = True) -> bool:
    """Turn off a Hugging Face model's KV cache (``config.use_cache``); return whether it was on.

    A recomputed decoder layer would append its keys and values to the cache a second time,
    so training with checkpointing needs it off, as HF's own gradient checkpointing does.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    config.use_cache = False
    if is_main:
        print("hpctrain: activation checkpointing: set model.config.use_cache = False "
              "(a recomputed layer would extend the KV cache again)", flush=True)
    return True


def checkpoint_blocks(model: nn.Module, is_main: bool | None = None) -> int:
    """Make each block recompute its activations in backward; return how many were wrapped.

    The forward is replaced on the instance, not by wrapping the module, so parameter names
    (and therefore checkpoints and gradient-reduction names) do not change. ``is_main``:
    whether this rank prints the one-line notes (default: the launcher's rank 0).
    """
    if is_main is None:
        is_main = _launcher_rank0()
    blocks = find_blocks(model)
    if not blocks and is_main:
        print(f"hpctrain: activation checkpointing found no blocks in {type(model).__name__} "
              "(elements of an nn.ModuleList, or an nn.Sequential's repeated children): "
              "nothing is recomputed", flush=True)
    disable_kv_cache(model, is_main)
    for _, block in blocks:
        if getattr(block, "_hpctrain_checkpointed", False):
            continue
        original = block.forward

        @functools.wraps(original)
        def forward(*args, _original=original, _block=block, **kwargs):
            return checkpoint_without_stat_updates(_block, _original, *args, **kwargs)

        block.forward = forward
        block._hpctrain_checkpointed = True
    return len(blocks)
