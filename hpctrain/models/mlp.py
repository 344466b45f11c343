"""Small MLP classifier with deliberately uneven layer sizes, and its factory."""

import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import make_classification

__all__ = ["MLP", "MLPBlock", "factory", "DEFAULTS"]

# Not powers of two and not divisible by 2 or 4, so sharding code meets uneven splits.
DEFAULTS = dict(in_features=37, hidden=83, layers=3, classes=11, n_samples=4096)


class MLPBlock(nn.Module):
    """One hidden Linear + GELU layer (the unit that activation checkpointing wraps)."""

    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        return F.gelu(self.fc(x))


class MLP(nn.Module):
    """Linear+GELU stem, `layers` hidden blocks, LayerNorm, linear classifier head."""

    def __init__(self, in_features=37, hidden=83, layers=3, classes=11):
        super().__init__()
        self.stem = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.gelu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def factory(seed=0, *, in_features=37, hidden=83, layers=3, classes=11, n_samples=4096):
    """Return (MLP, teacher-labelled classification data set, mean cross-entropy)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(in_features, hidden, layers, classes)
    data = make_classification(n_samples, in_features, classes, seed)
    return model, data, F.cross_entropy
