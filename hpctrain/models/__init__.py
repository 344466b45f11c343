"""hpctrain.models: built-in models and the registry that builds any model by spec."""

from .gpt import GPT, GPTBlock
from .mlp import MLP, MLPBlock
from .registry import BUILTIN, BuiltModel, build, describe, detect_unit

__all__ = ["BUILTIN", "BuiltModel", "build", "describe", "detect_unit", "GPT", "GPTBlock",
           "MLP", "MLPBlock"]
