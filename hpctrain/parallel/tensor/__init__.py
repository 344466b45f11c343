"""Tensor parallel (Megatron-LM's column/row-parallel layers, vocabulary-parallel embedding
and cross-entropy) and sequence parallel, over the mesh's tp group."""

from hpctrain.parallel.tensor.checks import TensorOptions, check, check_sharding, model_plan
from hpctrain.parallel.tensor.executor import TensorParallel
from hpctrain.parallel.tensor.transform import prepare, split_for_pricing

__all__ = ["TensorOptions", "TensorParallel", "check", "check_sharding", "model_plan",
           "prepare", "split_for_pricing"]
