"""hpctrain.data: synthetic data sets and the world-size-independent batch sampler."""

from .sampler import GlobalBatchSampler, collate
from .synthetic import TensorPairDataset, make_classification, make_markov_tokens, seeded_generator

__all__ = ["GlobalBatchSampler", "collate", "TensorPairDataset", "make_classification",
           "make_markov_tokens", "seeded_generator"]
