"""Batches as structures: a model input or target may be a tensor, a mapping of tensors (a
Hugging Face batch: ``input_ids``, ``attention_mask``; a tokenizer's BatchEncoding) or a
tuple/list of them. The trainer and the strategies walk them with these helpers, so a
model called as ``model(**inputs)`` trains as one called with a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["map_tensors", "rows", "to_device", "take_rows", "call_model", "zero_rows",
           "is_tensor", "check_batch", "leaves"]


def is_tensor(b) -> bool:
    return isinstance(b, torch.Tensor)


def map_tensors(fn, b):
    """``b`` with every tensor leaf replaced by ``fn(leaf)`` (mappings become dicts)."""
    if isinstance(b, torch.Tensor):
        return fn(b)
    if isinstance(b, Mapping):
        return {k: map_tensors(fn, v) for k, v in b.items()}
    if isinstance(b, (tuple, list)):
        return type(b)(map_tensors(fn, v) for v in b)
    return b


def leaves(b):
    """The tensors of a batch structure, in order."""
    if isinstance(b, torch.Tensor):
        yield b
    elif isinstance(b, Mapping):
        for v in b.values():
            yield from leaves(v)
    elif isinstance(b, (tuple, list)):
        for v in b:
            yield from leaves(v)


def rows(b) -> int:
    """Samples in a batch: the leading size of its tensors."""
    for t in leaves(b):
        return t.shape[0]
    raise TypeError(f"a batch without tensors ({type(b).__name__})")


def to_device(b, device, non_blocking: bool = False):
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), b)


def take_rows(b, index):
    """The rows ``index`` (a slice or index tensor) of every tensor of ``b``."""
    return map_tensors(lambda t: t[index], b)


def zero_rows(row):
    """A batch of no samples shaped as the one-sample item ``row`` (an empty rank's part)."""
    return map_tensors(lambda t: torch.empty((0, *t.shape), dtype=t.dtype), row)


def call_model(model, x):
    """``model(x)``; ``model(**x)`` for a mapping (keyword inputs, as Hugging Face models take
    them) and ``model(*x)`` for a tuple or list."""
    if isinstance(x, Mapping):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def check_batch(b) -> str | None:
    """Why ``b`` is not a batch (None when it is): tensors, mappings and tuples of them,
    every tensor with the same number of rows."""
    sizes = {t.shape[0] if t.dim() else None for t in leaves(b)}
    if not sizes:
        return "it holds no tensor"
    if len(sizes) > 1:
        return f"its tensors have different numbers of rows ({sorted(map(str, sizes))})"
    return None
