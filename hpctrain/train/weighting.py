"""What the loss is a mean over (``train.loss_weight``): each micro-batch's weight in a step.

``samples`` (the default): a micro-batch's mean loss counts by its share of the global
batch's samples. ``tokens``: by its share of the global batch's target elements other than
``ignore_index`` -- what one process computes when its loss is a mean over tokens (torch's
cross_entropy skips ignore_index) and samples hold different numbers of tokens (padding).
The global count takes one scalar all-reduce per step; a micro-batch with no valid token
gets a zero loss still connected to the model's output, so sharded strategies run the same
backward (and collectives) on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hpctrain.data.structure import leaves, rows

__all__ = ["LossWeighting"]


class LossWeighting:
    def __init__(self, mode: str = "samples", ignore_index: int = -100):
        self.mode, self.ignore_index = mode, ignore_index
        self.tokens = mode == "tokens"

    def count(self, y) -> int:
        """The units of target ``y`` that the loss averages over."""
        if not self.tokens:
            return rows(y)
        if isinstance(y, Mapping) and "labels" in y:
            y = y["labels"]
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"train.loss_weight = 'tokens' counts the target's elements other "
                            f"than {self.ignore_index}; the target is a {type(y).__name__} (give "
                            f"a tensor, or a dict with 'labels')")
        return int((y != self.ignore_index).sum())

    def wrap(self, loss_fn):
        """``loss_fn``, except on a target with no valid token (tokens mode): zero, still a
        function of the output (its mean would be NaN, and NaN x weight 0 is NaN)."""
        if not self.tokens:
            return loss_fn

        def weighted(out, y):
            if self.count(y):
                return loss_fn(out, y)
            return _zero_like_loss(out)

        if hasattr(loss_fn, "cross_entropy"):  # tensor parallel swaps a marked cross-entropy
            weighted.cross_entropy = loss_fn.cross_entropy
        weighted.__wrapped__ = loss_fn
        return weighted

    def weights(self, counts: list, global_count: float) -> list:
        return [c / global_count if global_count else 0.0 for c in counts]


def _zero_like_loss(out):
    """0 as a function of every floating tensor of ``out`` (a tensor, a ModelOutput, ...)."""
    parts = [t.float().sum() for t in leaves(out) if t.is_floating_point()]
    return sum(parts) * 0.0 if parts else torch.zeros(())
