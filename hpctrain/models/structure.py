"""What a model's repeated blocks are: the one definition that sharding units, auto-wrap
policies and activation checkpointing all use.

A block is an element of a container of repeated layers:

- every child of an ``nn.ModuleList`` (GPT's ``blocks``, HF decoders' ``layers``);
- a child of an ``nn.Sequential`` whose class occurs at least twice among that Sequential's
  children holding parameters (torchvision ResNet's ``layer1..4`` of BasicBlocks, timm ViT's
  ``blocks``, the blocks of a GPT written as ``Sequential(embed, block, ..., head)``); the
  Sequential's other children (an embedding, a head) are not blocks.

Blocks do not nest: a container inside a block is part of that block. Containers themselves
(ModuleList, ModuleDict) have no forward, so they are never blocks or units.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["CONTAINERS", "find_blocks", "is_container"]

# Modules that only hold others: their forward never runs, so hooks on them never fire.
CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def is_container(module: nn.Module) -> bool:
    """Whether module only holds other modules (no forward of its own)."""
    return isinstance(module, CONTAINERS)


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _block_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of module that are blocks (see the module docstring)."""
    if isinstance(module, nn.ModuleList):
        return list(module.named_children())
    if isinstance(module, nn.Sequential):
        children = [(k, c) for k, c in module.named_children() if _has_params(c)]
        counts = Counter(type(c) for _, c in children)
        return [(k, c) for k, c in children if counts[type(c)] > 1]
    return []


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every block of model, outermost only, in module order."""
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        blocks = dict(_block_children(module))
        for k, child in module.named_children():
            name = f"{prefix}.{k}" if prefix else k
            if k in blocks:
                out.append((name, child))
            else:
                visit(name, child)

    visit("", model)
    return out
