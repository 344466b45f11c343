"""Activation checkpointing whose recomputation has no side effects on BatchNorm statistics.

torch's checkpoint runs a block's forward twice: once in the forward pass, once more in
backward to rebuild the activations. A BatchNorm in training mode updates its running mean,
variance and ``num_batches_tracked`` on every forward, so a plain checkpoint counts each batch
twice and the model used for evaluation silently drifts from the one trained without
checkpointing. Here the recompute runs the BatchNorm layers with momentum 0 (the running
statistics are rewritten with their own values) and puts ``num_batches_tracked`` back: the
outputs, which use the batch statistics, are unchanged, and the buffers end as without
checkpointing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_without_stat_updates", "frozen_running_stats"]


@contextlib.contextmanager
def frozen_running_stats(module: nn.Module):
    """Within the block, BatchNorm layers of module in training mode normalise with batch
    statistics as usual but leave their running statistics as they were."""
    bns = [m for m in module.modules()
           if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    saved = [(m, m.momentum, None if m.num_batches_tracked is None
              else m.num_batches_tracked.clone()) for m in bns]
    for m in bns:
        m.momentum = 0.0  # running = 1 * running + 0 * batch: the same values
    try:
        yield
    finally:
        for m, momentum, count in saved:
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)


def _function_modes() -> list:
    return list(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def _recompute(module: nn.Module, modes: list):
    """The recompute keeps BatchNorm statistics and runs under the torch function modes the
    forward ran under (backward runs outside them; e.g. the domain split's, which makes the
    forward's own ops exact on tiles)."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        with frozen_running_stats(module):
            yield


def checkpoint_without_stat_updates(module: nn.Module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under non-reentrant activation checkpointing; during the
    recompute the BatchNorm layers of ``module`` (those fn runs) keep their statistics."""
    def contexts():  # called in the forward
        return contextlib.nullcontext(), _recompute(module, _function_modes())

    # Non-reentrant: works with kwargs, unused outputs and parameters without grads.
    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)
