"""Split a model's trainable parameters into units: the auto-wrap policies, and the partition.

Shared by the sharded strategies (zero, fsdp). A policy picks the modules that become units
(``wrapped_modules``): the model's blocks (``models.structure``), modules of named classes,
modules over a parameter count, or none. ``partition_modules`` then gives each unit the
parameters of its module; the root unit holds every other trainable parameter, including
any parameter that two units share (it is gathered the longest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from hpctrain.errors import UsageError
from hpctrain.parallel.unit_policy import WRAP_POLICIES, check_wrap_policy
from hpctrain.models.structure import find_blocks, is_container

__all__ = ["WRAP_POLICIES", "UnitSpec", "check_wrap_policy", "partition", "partition_modules",
           "rebind", "wrapped_modules"]



@dataclass
class UnitSpec:
    """The module a unit's hooks go on and its (first name, parameter) pairs.

    Given by a model-parallel transform (the pipeline's units: the parameters one set of
    its chunks use), ``module`` is None (the transform's executor gathers and frees). Where
    else the parameters live (a tied copy's other stages) is their placement
    (placement.py)."""

    name: str
    module: nn.Module | None
    params: list = field(default_factory=list)


def wrapped_modules(model: nn.Module, opts) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs the options' auto-wrap policy makes units of (root
    excluded). ``opts`` has ``auto_wrap_policy``, ``wrap_classes`` and ``min_params``
    (FSDPOptions, ZeroOptions). Containers (ModuleList, ModuleDict) are never units: their
    forward never runs, so their parameters would never be gathered."""
    policy = opts.auto_wrap_policy
    if policy == "none":
        return []
    if policy == "blocks":
        return find_blocks(model)
    if policy == "class":
        return _by_class(model, set(opts.wrap_classes))
    return _by_size(model, opts.min_params)


def rebind(model: nn.Module, wrapped: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The same units, by name, in model after some of its layers were swapped (e.g. for
    SyncBatchNorm): hooks must go on the modules that run."""
    return [(name, model.get_submodule(name)) for name, _ in wrapped]


def _by_class(model: nn.Module, wanted: set) -> list[tuple[str, nn.Module]]:
    out = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
    containers = sorted({type(m).__name__ for _, m in out if is_container(m)})
    if containers:
        raise UsageError(f"auto-wrap classes {containers} are containers without a forward of "
                         f"their own, so their units would never be gathered; name the class "
                         f"of their elements instead (e.g. the block class)")
    found = {type(m).__name__ for _, m in out}
    if wanted - found:
        names = sorted({type(m).__name__ for m in model.modules()})
        raise UsageError(f"auto-wrap classes {sorted(wanted - found)} match no module of "
                         f"{type(model).__name__}; its module classes are {names}; fix: set "
                         f"wrap_classes to some of those")
    return out


def _by_size(model: nn.Module, min_params: int) -> list[tuple[str, nn.Module]]:
    # Post-order, as torch's size_based_auto_wrap_policy: a module is wrapped when its
    # trainable parameters not already inside a wrapped child reach min_params; containers
    # pass their count up to their parent. A tied parameter counts once, where the walk
    # meets it first.
    out: list = []
    seen: set = set()

    def visit(name: str, m: nn.Module) -> int:
        left = sum(visit(f"{name}.{k}" if name else k, c) for k, c in m.named_children())
        for p in m.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                left += p.numel()
        if name and left >= min_params and not is_container(m):
            out.append((name, m))
            return 0
        return left

    visit("", model)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(out, key=lambda nm: order[nm[0]])


def partition(model: nn.Module, per_block: bool = True) -> tuple[list[UnitSpec], list]:
    """Return (units with trainable parameters, frozen (name, parameter) pairs), one unit per
    block; ``per_block=False`` puts every trainable parameter in the root unit.

    Tied parameters appear once, under the first name ``named_parameters`` gives them.
    """
    return partition_modules(model, find_blocks(model) if per_block else [])


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
