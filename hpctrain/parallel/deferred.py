"""Deferred initialisation: a model whose tensors are filled only where a rank keeps them.

A sharded or split strategy (zero3, fsdp FULL_SHARD/HYBRID, tensor parallel) keeps a part of
each parameter. Building the whole model first, on every rank, makes the build peak the full
model: the job that needed sharding dies before its first step. Instead:

1. the model is built on the meta device (shapes only, no memory, no init work);
2. each meta tensor becomes a *placeholder*: a CPU tensor of the right shape over ONE
   element of storage (set to NaN, so a placeholder used by mistake poisons the loss, which
   the non-finite guard stops, rather than training on garbage), tagged with where its
   values come from;
3. the strategy asks for values only for what it keeps (``values``: a flat shard's
   parameters, a tensor-parallel slice), and fills whatever is left at the end
   (``materialize``: frozen parameters, buffers).

The values come from a ``Materializer``: the model's LayerStack, each layer built for real
under its own seed (models/layers.py), exactly as one process builds it, one layer at a
time (the trainer asks models/registry.py for the meta model and its stack). So the equivalence with one process is unchanged, and the build peak is the rank's
share plus one layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hpctrain.parallel.placement import placement_of

__all__ = ["Materializer", "placeholders", "sliced_placeholder", "is_placeholder", "values",
           "filled", "materialize", "has_placeholders", "to_device"]

_ATTR = "_hpctrain_deferred"  # on a placeholder: (Materializer, whole-model tensor name)


class Materializer:
    """Real values of a model's tensors, by whole-model name, built one layer at a time
    from the model's LayerStack (the last layer built is kept for the next request: the
    strategies ask in model order)."""

    def __init__(self, stack, device="cpu"):
        self.stack, self.device = stack, torch.device(device)
        self._layer_of: dict[str, int] | None = None
        self._cached: tuple[int, dict] | None = None
        self.layers_built = 0

    def _index(self) -> dict[str, int]:
        """Module path -> layer, from a meta build of every layer (free)."""
        if self._layer_of is None:
            self._layer_of = {}
            for i, layer in enumerate(self.stack.layers):
                with torch.device("meta"):
                    for path in layer.build():
                        self._layer_of[path] = i
        return self._layer_of

    def _layer(self, name: str) -> int:
        index = self._index()
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            i = index.get(".".join(parts[:k]))
            if i is not None:
                return i
        raise KeyError(f"deferred init: no layer of the model builds {name!r}")

    def value(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` as one process initialises it (do not modify it)."""
        i = self._layer(name)
        if self._cached is None or self._cached[0] != i:
            self._cached = None  # drop the previous layer before building the next
            tensors = {}
            for path, module in self.stack.layers[i].build().items():
                for key, t in module.state_dict(keep_vars=True).items():
                    tensors[f"{path}.{key}"] = t.detach()
            self._cached = (i, tensors)
            self.layers_built += 1
        return self._cached[1][name]

    def release(self) -> None:
        """Forget the cached layer (its memory goes back)."""
        self._cached = None


def _placeholder(shape, dtype, requires_grad, source, placement=None, device="cpu"):
    data = torch.full((), math.nan if dtype.is_floating_point else 0, dtype=dtype,
                      device=device).expand(tuple(shape))
    t = nn.Parameter(data, requires_grad=requires_grad) if requires_grad is not None else data
    setattr(t, _ATTR, source)
    if placement is not None:
        setattr(t, "_hpctrain_placement", placement)
    return t


def is_placeholder(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _ATTR, None) is not None


def placeholders(model: nn.Module, materializer: Materializer) -> int:
    """Replace every meta parameter and buffer of ``model`` by a placeholder naming its
    whole-model name (a tied tensor: one placeholder, shared as the meta one was). Returns
    how many there were."""
    made: dict[int, torch.Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = _placeholder(p.shape, p.dtype, p.requires_grad,
                                           (materializer, prefix + key))
            module._parameters[key] = made[id(p)]
        for key, b in list(module._buffers.items()):
            if b is None or not b.is_meta:
                continue
            if id(b) not in made:
                made[id(b)] = _placeholder(b.shape, b.dtype, None, (materializer, prefix + key))
            module._buffers[key] = made[id(b)]
    return len(made)


def sliced_placeholder(source: torch.Tensor, shape, placement) -> nn.Parameter:
    """A placeholder for a slice of ``source``'s tensor (``placement`` says which box of the
    whole tensor): a split transform cuts placeholders without reading them."""
    return _placeholder(shape, source.dtype, source.requires_grad, getattr(source, _ATTR),
                        placement)


def values(t: torch.Tensor, device=None, copy: bool = True) -> torch.Tensor:
    """The real values of ``t``: itself when it is real; for a placeholder, the box of the
    whole tensor its placement names (all of it when whole), as a new tensor (``copy=False``:
    possibly a view of the Materializer's cached layer, to be copied by the caller)."""
    if not is_placeholder(t):
        return t.detach()
    materializer, name = getattr(t, _ATTR)
    whole = materializer.value(name)
    box = placement_of(t).box(tuple(t.shape))
    if box is not None:
        offset, count, *view = box
        v = whole.reshape(view[0]) if view else whole
        for d, (o, c) in enumerate(zip(offset, count)):
            v = v.narrow(d, o, c)
        whole = v.reshape(tuple(t.shape))
    return whole.to(device if device is not None else t.device, copy=copy)


def filled(t: torch.Tensor) -> None:
    """``t`` (a placeholder) now holds its values: it is a placeholder no more. When the last
    one goes, the Materializer and its cached layer go with it."""
    if is_placeholder(t):
        delattr(t, _ATTR)


def materialize(model: nn.Module, device=None) -> int:
    """Fill every placeholder parameter and buffer still in ``model`` (in place: the
    Parameter objects stay, so optimizers and hooks keep them). Returns how many."""
    done: set[int] = set()
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for t in store.values():
                if t is None or id(t) in done or not is_placeholder(t):
                    continue
                done.add(id(t))
                t.data = values(t, device)
                filled(t)
    return len(done)


def has_placeholders(model: nn.Module) -> bool:
    return any(is_placeholder(t) for t in list(model.parameters()) + list(model.buffers()))


def to_device(model: nn.Module, device) -> None:
    """``model.to(device)`` that keeps placeholders placeholders (moving one would make it a
    dense tensor of its full size)."""
    device = torch.device(device)
    if not has_placeholders(model):
        model.to(device)
        return
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for key, t in store.items():
                if t is None or t.device == device:
                    continue
                if is_placeholder(t):  # its one element, moved, expanded again
                    t.data = t.data.as_strided((), ()).to(device).expand(t.shape)
                else:
                    t.data = t.data.to(device)
