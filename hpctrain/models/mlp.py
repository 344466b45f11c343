"""Small MLP classifier with deliberately uneven layer sizes, and its factory."""

import torch
import torch.nn.functional as F
from torch import nn

from ..data.synthetic import make_classification
from .layers import LayerStack, PipeLayer, seeded

__all__ = ["MLP", "MLPBlock", "factory", "mlp_layers", "pipeline", "DEFAULTS"]

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

    def __init__(self, in_features=37, hidden=83, layers=3, classes=11, seed=0):
        super().__init__()
        # Built layer by layer (each under its own seed) so pipeline stages match it.
        built = {}
        for layer in mlp_layers(in_features, hidden, layers, classes, seed).layers:
            built.update(layer.build())
        self.stem = built["stem"]
        self.blocks = nn.ModuleList(built[f"blocks.{i}"] for i in range(layers))
        self.norm = built["norm"]
        self.head = built["head"]

    def forward(self, x):
        x = F.gelu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mlp_layers(in_features=37, hidden=83, layers=3, classes=11, seed=0) -> LayerStack:
    """The MLP as layers: stem, one per hidden block, LayerNorm + head."""
    def stem():
        return seeded(seed, 0, lambda: {"stem": nn.Linear(in_features, hidden)})

    def block(i):
        return lambda: seeded(seed, i + 1, lambda: {f"blocks.{i}": MLPBlock(hidden)})

    def head():
        return seeded(seed, layers + 1, lambda: {"norm": nn.LayerNorm(hidden),
                                                 "head": nn.Linear(hidden, classes)})

    out = [PipeLayer("stem", stem, lambda root, x: F.gelu(root.stem(x)))]
    out += [PipeLayer(f"blocks.{i}", block(i),
                      lambda root, x, i=i: root.get_submodule(f"blocks.{i}")(x))
            for i in range(layers)]
    out.append(PipeLayer("head", head, lambda root, x: root.head(root.norm(x))))
    return LayerStack(out)


def factory(seed=0, *, in_features=37, hidden=83, layers=3, classes=11, n_samples=4096):
    """Return (MLP, teacher-labelled classification data set, mean cross-entropy)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(in_features, hidden, layers, classes, seed)
    data = make_classification(n_samples, in_features, classes, seed)
    return model, data, F.cross_entropy


def pipeline(seed=0, *, in_features=37, hidden=83, layers=3, classes=11, n_samples=4096):
    """Return (LayerStack of the factory's MLP, its data set, loss); builds no weights."""
    return (mlp_layers(in_features, hidden, layers, classes, seed),
            make_classification(n_samples, in_features, classes, seed), F.cross_entropy)
