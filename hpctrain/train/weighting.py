"""What the loss is a mean over (``train.loss_weight``): each micro-batch's weight in a step.

``samples`` (the default): a micro-batch's mean loss counts by its share of the global
batch's samples. ``tokens``: by its share of the global batch's target elements other than
``ignore_index`` -- what one process computes when its loss is a mean over tokens (torch's
cross_entropy skips ignore_index) and samples hold different numbers of tokens (padding).
A loss that averages over other elements declares what it counts, ``loss_fn.count_units =
fn(target) -> int``: a Hugging Face style loss whose labels are the inputs, shifted inside
the loss, counts ``target[..., 1:]`` (``shifted_count``), as transformers counts its
``num_items_in_batch``; the weights are then the loss's own counts, so both conventions
give one process's mean.
The global count takes one scalar all-reduce per step; a micro-batch with no valid token
gets a zero loss still connected to the model's output, so sharded strategies run the same
backward (and collectives) on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hpctrain.data.structure import leaves, rows

__all__ = ["LossWeighting", "shifted_count"]


def shifted_count(ignore_index: int = -100):
    """count_units of a loss that shifts its labels inside (labels = input_ids, position t
    predicting token t + 1): the labels after the first of each row, other than
    ``ignore_index``."""
    def count(y) -> int:
        if isinstance(y, Mapping) and "labels" in y:
            y = y["labels"]
        return int((y[..., 1:] != ignore_index).sum())
    return count


class LossWeighting:
    def __init__(self, mode: str = "samples", ignore_index: int = -100):
        self.mode, self.ignore_index = mode, ignore_index
        self.tokens = mode == "tokens"
        self._declared: list = []  # (loss_fn, count) found by measuring (train/loss_count.py)

    def declare(self, loss_fn, count) -> None:
        """Count ``loss_fn``'s units with ``count`` (as its own count_units would)."""
        self._declared.append((loss_fn, count))

    def counter(self, loss_fn):
        """target -> the units ``loss_fn`` averages over: samples; tokens: the loss's own
        ``count_units`` when it declares one, else ``count``."""
        own = getattr(loss_fn, "count_units", None)
        own = next((c for f, c in self._declared if f is loss_fn), own)
        if not self.tokens or own is None:
            return self.count
        if not callable(own):
            raise TypeError(f"loss_fn.count_units is a {type(own).__name__}; expected a "
                            f"function target -> number of units the loss averages over")
        return lambda y: int(own(y))

    def count(self, y) -> int:
        """The units of target ``y`` that a loss averages over (its samples, or its target
        elements other than ``ignore_index``)."""
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
        count = self.counter(loss_fn)

        def weighted(out, y):
            if count(y):
                return loss_fn(out, y)
            return _zero_like_loss(out)

        if hasattr(loss_fn, "cross_entropy"):  # tensor parallel swaps a marked cross-entropy
            weighted.cross_entropy = loss_fn.cross_entropy
        weighted.count_units = count
        weighted.__wrapped__ = loss_fn
        return weighted

    def weights(self, counts: list, global_count: float) -> list:
        return [c / global_count if global_count else 0.0 for c in counts]


def _zero_like_loss(out):
    """0 as a function of every floating tensor of ``out`` (a tensor, a ModelOutput, ...)."""
    parts = [t.float().sum() for t in leaves(out) if t.is_floating_point()]
    return sum(parts) * 0.0 if parts else torch.zeros(())
