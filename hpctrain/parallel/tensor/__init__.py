"""Tensor parallel (Megatron-LM's column/row-parallel layers, vocabulary-parallel embedding
and cross-entropy) and sequence parallel, over the mesh's tp group.

Names load on first use, so ``options`` (the [tensor] config table) imports no torch."""

import importlib

__all__ = ["TensorOptions", "TensorParallel", "check", "check_sharding", "model_plan",
           "prepare", "split_for_pricing"]

_HOME = {"TensorOptions": "options", "TensorParallel": "executor", "check": "checks",
         "check_sharding": "checks", "model_plan": "checks", "prepare": "transform",
         "split_for_pricing": "transform"}


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
