"""Tensor-parallel layers: torch modules whose class is swapped in place (parameters keep
their names, so checkpoints and optimizer state stay keyed as in the whole model).

A swapped module holds this rank's slice of its weight (the transform sliced it) and runs
Megatron-LM's pattern over the tp group ``tp``:

- ``ColumnParallelLinear``: output features split; the input is copied (``copy_to``) or,
  under sequence parallel, all-gathered from the sequence chunks (``gather_seq``);
- ``RowParallelLinear``: input features split; the partial outputs are all-reduced
  (``reduce_from``) or reduce-scattered into sequence chunks, then the bias is added once;
- ``column_conv1d``/``row_conv1d``: the same for a Hugging Face ``Conv1D`` (GPT-2), a Linear
  whose weight is stored (in, out);
- ``VocabParallelEmbedding``: vocabulary rows split; tokens of other ranks give zeros, the
  partial embeddings are summed as a row-parallel output is (a ``padding_idx`` row is held
  by one rank, which keeps its gradient zero);
- ``SequenceSplitEmbedding``: a replicated embedding (positions) whose output is cut to
  this rank's sequence chunk under sequence parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.tensor.ops import (copy_to, gather_seq, reduce_from,
                                          reduce_scatter_seq, split_seq)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "SequenceSplitEmbedding", "swap_class", "is_conv1d", "column_conv1d", "row_conv1d"]


def swap_class(module: nn.Module, cls: type, **attrs) -> nn.Module:
    """Make module an instance of cls (a subclass of its class) with attrs set."""
    module.__class__ = cls
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


class ColumnParallelLinear(nn.Linear):
    tp = None
    sequence_parallel = False

    def forward(self, x):
        x = gather_seq(x, self.tp) if self.sequence_parallel else copy_to(x, self.tp)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    tp = None
    sequence_parallel = False

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = reduce_scatter_seq(y, self.tp) if self.sequence_parallel else reduce_from(y, self.tp)
        return y if self.bias is None else y + self.bias


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``Conv1D`` (transformers.pytorch_utils: GPT-2's projections), which
    computes ``bias + x @ weight`` with weight (in, out)."""
    return any(c.__name__ == "Conv1D" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def _conv1d(x, weight, bias):
    """Conv1D's forward on (..., in) with a weight (in, out) slice."""
    flat = x.reshape(-1, x.shape[-1])
    y = flat @ weight if bias is None else torch.addmm(bias, flat, weight)
    return y.view(*x.shape[:-1], weight.shape[1])


class _ColumnConv1D:
    tp = None
    sequence_parallel = False

    def forward(self, x):
        x = gather_seq(x, self.tp) if self.sequence_parallel else copy_to(x, self.tp)
        return _conv1d(x, self.weight, self.bias)


class _RowConv1D:
    tp = None
    sequence_parallel = False

    def forward(self, x):
        y = _conv1d(x, self.weight, None)
        y = reduce_scatter_seq(y, self.tp) if self.sequence_parallel else reduce_from(y, self.tp)
        return y + self.bias


_CONV1D: dict = {}


def _conv1d_class(mixin: type, base: type) -> type:
    """mixin over the module's own Conv1D class (transformers is not imported here)."""
    key = (mixin, base)
    if key not in _CONV1D:
        name = ("ColumnParallel" if mixin is _ColumnConv1D else "RowParallel") + base.__name__
        _CONV1D[key] = type(name, (mixin, base), {})
    return _CONV1D[key]


def column_conv1d(module: nn.Module) -> type:
    """The column-parallel class for a Conv1D ``module`` (output features split)."""
    return _conv1d_class(_ColumnConv1D, type(module))


def row_conv1d(module: nn.Module) -> type:
    """The row-parallel class for a Conv1D ``module`` (input features split, bias once)."""
    return _conv1d_class(_RowConv1D, type(module))


class VocabParallelEmbedding(nn.Embedding):
    tp = None
    sequence_parallel = False
    vocab_start = 0

    def forward(self, idx):
        local = idx - self.vocab_start
        n = self.weight.shape[0]
        outside = (local < 0) | (local >= n)
        pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start
        out = F.embedding(local.masked_fill(outside, 0), self.weight,
                          padding_idx=pad if pad is not None and 0 <= pad < n else None)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.tp) if self.sequence_parallel else \
            reduce_from(out, self.tp)


class SequenceSplitEmbedding(nn.Embedding):
    tp = None

    def forward(self, idx):
        return split_seq(super().forward(idx), self.tp)
