"""Split a model's trainable parameters into units: one per repeated block, plus a root.

Shared by the sharded strategies (zero, fsdp). A block is an element of a top-level
``nn.ModuleList`` (e.g. GPT's ``blocks``); the root unit holds every other trainable
parameter, including any parameter that two units share (it is gathered the longest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["UnitSpec", "partition", "partition_modules"]


@dataclass
class UnitSpec:
    """The module a unit's hooks go on and its (first name, parameter) pairs."""

    name: str
    module: nn.Module
    params: list = field(default_factory=list)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or any(name.startswith(b + ".") for b, _ in blocks):
            continue
        blocks += [(f"{name}.{k}" if name else k, child) for k, child in m.named_children()]
    return blocks


def partition(model: nn.Module, per_block: bool = True) -> tuple[list[UnitSpec], list]:
    """Return (units with trainable parameters, frozen (name, parameter) pairs).

    Tied parameters appear once, under the first name ``named_parameters`` gives them;
    ``per_block=False`` puts every trainable parameter in the root unit.
    """
    return partition_modules(model, _blocks(model) if per_block else [])


def partition_modules(model: nn.Module, wrapped: list[tuple[str, nn.Module]]
                      ) -> tuple[list[UnitSpec], list]:
    """As ``partition``, with one unit per given (qualified name, submodule), which may nest.

    A parameter belongs to the innermost wrapped module that holds it; one held by two
    units (tied across them) goes to the root, which is gathered the longest.
    """
    blocks = sorted(wrapped, key=lambda b: -len(b[0]))  # innermost (longest name) first
    index = {b: i for i, (b, _) in enumerate(wrapped)}
    homes: dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = next((index[b] for b, _ in blocks if name.startswith(b + ".")), -1)
        homes.setdefault(id(p), set()).add(owner)
    units = [UnitSpec(b, m) for b, m in wrapped]
    root = UnitSpec("<root>", model)
    frozen = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            frozen.append((name, p))
            continue
        owners = homes[id(p)]
        (units[owners.pop()] if len(owners) == 1 and -1 not in owners else root).params.append((name, p))
    return [u for u in units + [root] if u.params], frozen
