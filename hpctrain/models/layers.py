"""A model as an ordered list of layers, so a pipeline stage can build only its own layers.

Each layer builds its modules under its OWN seed (derived from the model seed and the layer's
index), so a layer's initial weights do not depend on which other layers a process builds:
the whole model (single process) and any split of it (pipeline stages) start identical.
Modules are mounted at the paths they have in the whole model, so parameter names, and with
them checkpoints, are the same under every strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

__all__ = ["PipeLayer", "LayerStack", "StackModel", "layer_seed", "seeded", "mount",
           "from_sequential", "shared_parameters", "split_input", "check_input", "run_layer"]

_MASK63 = (1 << 63) - 1


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index`` of a model seeded with ``seed`` (index -1: tied tensors)."""
    return (int(seed) * 1_000_003 + 7919 * (index + 2)) & _MASK63


def seeded(seed: int, index: int, build: Callable[[], object]):
    """Call build() with torch's CPU RNG seeded for layer ``index``; the caller's RNG is kept."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        return build()


@dataclass(frozen=True)
class PipeLayer:
    """One layer: ``build()`` -> {path in the whole model: module}; ``forward(root, x)`` runs
    it, finding its modules under ``root`` by those paths. ``side``: inputs of the batch
    besides the tensor that flows through the layers (e.g. ``attention_mask``) that forward
    takes as keywords; every stage reads them from its own copy of the micro-batch."""

    name: str
    build: Callable[[], dict]
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    side: tuple = ()


@dataclass
class LayerStack:
    """A model described layer by layer, built lazily (nothing is materialised here).

    ``tied`` maps a parameter path to the path of the parameter it shares storage with in the
    whole model (e.g. ``{"head.weight": "tok_emb.weight"}``); the owner's name is canonical.
    """

    layers: list
    tied: dict = field(default_factory=dict)
    # Tensor-parallel plan of the whole model (module-name patterns -> styles; see
    # parallel/tensor), when it has one.
    tp_plan: dict = field(default_factory=dict)
    # The keys of a dict input the layers take (a Hugging Face batch): the first is the
    # tensor given to the first layer, the others are side inputs (PipeLayer.side). Empty:
    # the input is one tensor.
    inputs: tuple = ()
    # The built module these layers were split from (models/chain.py), whose declarations
    # (a Hugging Face model's config and tensor-parallel plan) describe the stack too.
    source: object = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.layers)

    def param_counts(self) -> list[int]:
        """Parameters per layer, counted on the meta device (no memory, no init work)."""
        counts = []
        for layer in self.layers:
            with torch.device("meta"):
                mods = layer.build()
            counts.append(sum(p.numel() for m in mods.values() for p in m.parameters()))
        return counts

    def module(self) -> "StackModel":
        """The whole model as one module (every layer built, tied tensors shared), whose
        forward runs the layers' forwards in order: what one process trains."""
        return StackModel(self)

    def build(self, indices) -> nn.Module:
        """A root module holding the layers ``indices``, mounted at their whole-model paths.

        Tied parameters whose owner is also built are shared as in the whole model; a tied
        parameter built without its owner stays a separate copy with the same initial value.
        """
        root = nn.Module()
        for i in indices:
            for path, module in self.layers[i].build().items():
                mount(root, path, module)
        for alias, owner in self.tied.items():
            if _has(root, alias) and _has(root, owner):
                mod_path, _, pname = alias.rpartition(".")
                setattr(root.get_submodule(mod_path), pname, root.get_parameter(owner))
        return root


class StackModel(nn.Module):
    """A LayerStack built whole: its layers' modules mounted at their paths, and a forward
    that runs the layers' forwards in order. A user factory may return a LayerStack instead
    of a module; then every strategy builds from it, and deferred initialisation fills each
    rank's part layer by layer (parallel/deferred.py)."""

    def __init__(self, stack: LayerStack):
        super().__init__()
        root = stack.build(range(len(stack)))
        for name, child in root.named_children():
            self.add_module(name, child)
        self._layers, self._inputs = tuple(stack.layers), stack.inputs

    def forward(self, x=None, **inputs):
        if inputs:  # model(**batch): a dict input (LayerStack.inputs)
            x = inputs
        x, side = split_input(self._inputs, x)
        for layer in self._layers:
            x = run_layer(layer, self, x, side)
        return x


def check_input(stack: LayerStack, x) -> None:
    """TypeError unless ``x`` (a batch's input) is what the stack's layers take: one tensor,
    or a dict whose keys are among ``stack.inputs`` and hold its first one."""
    if not isinstance(x, Mapping):
        return
    keys = sorted(x)
    if not stack.inputs:
        raise TypeError(f"the pipeline passes one tensor through the model's layers, but the "
                        f"input is a dict with keys {keys}; give the model one tensor (e.g. "
                        f"input_ids), or a Hugging Face GPT-2/Llama, whose stages also take "
                        f"attention_mask")
    unknown = [k for k in keys if k not in stack.inputs]
    if unknown or stack.inputs[0] not in x:
        raise TypeError(f"the pipeline's layers take the inputs {list(stack.inputs)} (the "
                        f"first required), but the input dict has keys {keys}; drop "
                        f"{unknown or keys} from the batch (positions and the causal mask are "
                        f"recomputed in every stage)")


def split_input(stack_inputs: tuple, x):
    """(the tensor the first layer takes, {side input name: tensor}) of a batch's input."""
    if not isinstance(x, Mapping):
        return x, {}
    main = stack_inputs[0]
    return x[main], {k: v for k, v in x.items() if k != main}


def run_layer(layer: PipeLayer, root: nn.Module, x, side: dict):
    """``layer.forward(root, x)`` with the side inputs it declares."""
    if not layer.side:
        return layer.forward(root, x)
    return layer.forward(root, x, **{k: side[k] for k in layer.side if k in side})


def _has(root: nn.Module, path: str) -> bool:
    try:
        root.get_parameter(path)
        return True
    except AttributeError:
        return False


def mount(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register module at dotted ``path`` under root, creating ModuleDict containers."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.ModuleDict())
        node = node._modules[part]
    if leaf in node._modules:
        raise ValueError(f"two layers both build the module at {path!r}; each path belongs to "
                         "exactly one layer")
    node.add_module(leaf, module)


def from_sequential(model: nn.Sequential) -> LayerStack:
    """Layers of an already built nn.Sequential: one per child (the model was built whole).

    A parameter shared by several children (an embedding tied to the output head, a module
    repeated in the Sequential) is declared tied, owned by the first child using it, so
    stages that each hold a copy keep them identical (the pipeline sums their gradients).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"pipeline splitting needs an nn.Sequential model, a LayerStack or a "
                        f"built-in model, got {type(model).__name__}; fix: express the model as "
                        f"an nn.Sequential of its layers (e.g. Sequential(embed, *blocks, head)) "
                        f"or describe it as a models.layers.LayerStack")
    # _modules, not named_children(): a module repeated in the Sequential is a layer each time.
    children = list(model._modules.items())

    def layer(name, module):
        return PipeLayer(name, lambda: {name: module},
                         lambda root, x: root.get_submodule(name)(x))

    return LayerStack([layer(n, m) for n, m in children], tied=shared_parameters(model))


def shared_parameters(model: nn.Module) -> dict:
    """{parameter path: path of its first use} for every parameter reachable by several paths."""
    first: dict = {}
    tied: dict = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[path] = first[id(p)]
        else:
            first[id(p)] = path
    return tied
