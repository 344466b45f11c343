"""Tensor-parallel layers: torch modules whose class is swapped in place (parameters keep
their names, so checkpoints and optimizer state stay keyed as in the whole model).

A swapped module holds this rank's slice of its weight (the transform sliced it) and runs
Megatron-LM's pattern over the tp group ``tp``:

- ``ColumnParallelLinear``: output features split; the input is copied (``copy_to``) or,
  under sequence parallel, all-gathered from the sequence chunks (``gather_seq``);
- ``RowParallelLinear``: input features split; the partial outputs are all-reduced
  (``reduce_from``) or reduce-scattered into sequence chunks, then the bias is added once;
- ``VocabParallelEmbedding``: vocabulary rows split; tokens of other ranks give zeros, the
  partial embeddings are summed as a row-parallel output is;
- ``SequenceSplitEmbedding``: a replicated embedding (positions) whose output is cut to
  this rank's sequence chunk under sequence parallel.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from hpctrain.parallel.tensor.ops import (copy_to, gather_seq, reduce_from,
                                          reduce_scatter_seq, split_seq)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "SequenceSplitEmbedding", "swap_class"]


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


class VocabParallelEmbedding(nn.Embedding):
    tp = None
    sequence_parallel = False
    vocab_start = 0

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(out, self.tp) if self.sequence_parallel else \
            reduce_from(out, self.tp)


class SequenceSplitEmbedding(nn.Embedding):
    tp = None

    def forward(self, idx):
        return split_seq(super().forward(idx), self.tp)
