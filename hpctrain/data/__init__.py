"""hpctrain.data: synthetic data sets, the world-size-independent batch sampler, and the
readers of a user's DataLoader (loader.py: workers, IterableDatasets)."""

from .sampler import GlobalBatchSampler, collate
from .synthetic import TensorPairDataset, make_classification, make_markov_tokens, seeded_generator

__all__ = ["GlobalBatchSampler", "collate", "TensorPairDataset", "make_classification",
           "make_markov_tokens", "seeded_generator"]
