"""Seeded synthetic data sets for the built-in models."""

import torch
from torch.utils.data import Dataset

from .structure import rows, take_rows

__all__ = ["TensorPairDataset", "seeded_generator", "make_classification", "make_markov_tokens"]

_MASK64 = (1 << 64) - 1


def seeded_generator(seed, stream=0):
    """A CPU torch.Generator seeded from (seed, stream), independent of the global RNG."""
    g = torch.Generator()
    # Mixing in a stream id keeps e.g. the inputs and the teacher on separate random streams.
    g.manual_seed((int(seed) * 0x9E3779B1 + int(stream)) & _MASK64)
    return g


class TensorPairDataset(Dataset):
    """Map-style data set of (inputs[i], targets[i]) pairs held as two tensors."""

    def __init__(self, inputs, targets):
        n, m = rows(inputs), rows(targets)  # tensors, or dicts/tuples of them (a batch)
        if n != m:
            raise ValueError(f"inputs has {n} rows but targets has {m}; "
                             "they must have the same length")
        self.inputs = inputs
        self.targets = targets

    def __len__(self):
        return rows(self.inputs)

    def __getitem__(self, i):
        return take_rows(self.inputs, i), take_rows(self.targets, i)


def make_classification(n_samples, in_features, n_classes, seed, teacher_hidden=23):
    """Inputs x ~ N(0, 1), labels = argmax of a fixed random 2-layer teacher net (learnable)."""
    g = seeded_generator(seed, 1)
    x = torch.randn(n_samples, in_features, generator=g)
    w1 = torch.randn(in_features, teacher_hidden, generator=g) / in_features ** 0.5
    w2 = torch.randn(teacher_hidden, n_classes, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorPairDataset(x, y.to(torch.int64))


def make_markov_tokens(n_samples, seq_len, vocab, seed, branching=3):
    """Token sequences from an order-1 Markov chain whose rows have `branching` likely successors.

    Returns samples (seq[:-1], seq[1:]) as int64, so the best possible cross-entropy is the
    chain's entropy (about ln(branching) or less), far below ln(vocab).
    """
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching must be in [1, vocab={vocab}], got {branching}")
    g = seeded_generator(seed, 2)
    # Sparse transition table: each token moves to one of `branching` random successors.
    succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
    weights = torch.rand(vocab, branching, generator=g) + 0.25
    table = torch.zeros(vocab, vocab).scatter_(1, succ, weights)
    table /= table.sum(dim=1, keepdim=True)
    seqs = torch.empty(n_samples, seq_len + 1, dtype=torch.int64)
    seqs[:, 0] = torch.randint(vocab, (n_samples,), generator=g)
    for t in range(1, seq_len + 1):
        seqs[:, t] = torch.multinomial(table[seqs[:, t - 1]], 1, generator=g).squeeze(1)
    return TensorPairDataset(seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous())
