"""Dropout whose mask does not depend on how the activation is split over ranks.

The mask is drawn for the WHOLE activation from torch's RNG and this rank keeps its slice,
so a model-parallel rank holding some heads (tensor parallel) or a sequence chunk (sequence
parallel) applies exactly the mask one process would: the tensor-parallel ranks of a replica
draw the same numbers in the same order, as their RNG states stay equal. Megatron keeps a
separate model-parallel RNG state per rank instead, which trains correctly but not like one
process; drawing the whole mask costs tp times the random numbers of the slice.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["Dropout", "DropoutUse", "find_dropout"]


class Dropout(nn.Module):
    """nn.Dropout with split-invariant masks. ``shards``: ((dim, index, count), ...) set by a
    model-parallel transform: along ``dim`` the local activation is chunk ``index`` of
    ``count`` equal chunks of the whole one."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must be in [0, 1)")
        self.p = float(p)
        self.shards: tuple = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        for dim, _, count in self.shards:
            shape[dim] *= count
        keep = torch.rand(shape, device=x.device) >= self.p  # fp32 draws under any autocast
        for dim, index, _ in self.shards:
            n = x.shape[dim]
            keep = keep.narrow(dim, index * n, n)
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}" + (f", shards={self.shards}" if self.shards else "")


# -- finding the dropout a model applies (train/dropout.py decides what a plan does with it) --

@dataclass(frozen=True)
class DropoutUse:
    """Dropout with p > 0 in a model: ``where`` names the module (and the code line of a
    functional call, or the config field); ``exact``: hpctrain's Dropout, whose masks do not
    depend on a split (models.dropout.Dropout)."""

    where: str
    p: float
    exact: bool = False


_MODULES = (Dropout, nn.modules.dropout._DropoutNd)
# Functional dropout and the index/keyword of its probability (and of `training`, if any).
_FUNCTIONAL = {
    F.dropout: (1, "p", 2), F.alpha_dropout: (1, "p", 2), F.feature_alpha_dropout: (1, "p", 2),
    F.dropout1d: (1, "p", 2), F.dropout2d: (1, "p", 2), F.dropout3d: (1, "p", 2),
    torch.dropout: (1, "p", 2), torch.dropout_: (1, "p", 2), torch.alpha_dropout: (1, "p", 2),
    torch.feature_dropout: (1, "p", 2), torch.feature_alpha_dropout: (1, "p", 2),
    F.scaled_dot_product_attention: (4, "dropout_p", None),
}


def _arg(args, kwargs, index, name, default):
    if name in kwargs:
        return kwargs[name]
    return args[index] if index is not None and len(args) > index else default


class _Calls(TorchFunctionMode):
    """Records functional dropout with p > 0 in training, with the innermost module running
    (a hook stack) and the calling line of the model's code."""

    def __init__(self):
        super().__init__()
        self.modules: list = []
        self.found: list[DropoutUse] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spec = _FUNCTIONAL.get(func)
        if spec is not None:
            p = float(_arg(args, kwargs, spec[0], spec[1], 0.5 if spec[2] else 0.0) or 0.0)
            training = bool(_arg(args, kwargs, spec[2], "training", True))
            inside = self.modules[-1] if self.modules else ("", None)
            if p > 0 and training and not isinstance(inside[1], _MODULES):  # those: counted
                name = getattr(func, "__name__", str(func))
                self.found.append(DropoutUse(f"{inside[0] or 'the model'} ({name} at "
                                             f"{_caller()})", p))
        return func(*args, **kwargs)


def _caller() -> str:
    """file:line of the innermost frame outside torch (the model's code calling dropout)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.filename != __file__:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


# Hugging Face config fields of the dropout its attention functions apply (functionally,
# where no module shows it); other dropout fields make modules, which are found as such.
_ATTENTION_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def _config_fields(model: nn.Module) -> list[DropoutUse]:
    """Attention dropout probabilities in Hugging Face configs (_ATTENTION_FIELDS)."""
    seen, out = set(), []
    for name, m in model.named_modules():
        config = getattr(m, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        for key in _ATTENTION_FIELDS:
            value = getattr(config, key, None)
            if isinstance(value, (int, float)) and value > 0:
                out.append(DropoutUse(f"{name or type(m).__name__}.config.{key}", float(value)))
    return out


def find_dropout(model: nn.Module, sample=None) -> list[DropoutUse]:
    """Every dropout with p > 0 in ``model``: dropout modules, Hugging Face config fields,
    and, given a sample input (a tensor or a dict of keyword inputs), the functional
    dropout its forward calls in training mode (traced once on the sample; the RNG, the
    buffers and the modes are restored). Pure: no communication."""
    found = _config_fields(model) + [
        DropoutUse(name, m.p, isinstance(m, Dropout)) for name, m in model.named_modules()
        if isinstance(m, _MODULES) and m.p > 0]
    if sample is None or any(t.is_meta for t in model.parameters()):
        return found
    calls = _Calls()
    def enter(name):
        def hook(module, _):
            calls.modules.append((name, module))
        return hook

    def leave(*_):
        calls.modules.pop()  # returns None: the output stays the module's

    hooks = [m.register_forward_pre_hook(enter(name)) for name, m in model.named_modules()]
    hooks += [m.register_forward_hook(leave) for m in model.modules()]
    modes = {m: m.training for m in model.modules()}
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    try:
        model.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]), calls:
            model(**sample) if isinstance(sample, Mapping) else model(sample)
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes.items():
            m.training = training
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    return _unique(calls.found) + found


def _unique(uses: list) -> list:
    out, seen = [], set()
    for u in uses:
        if u.where not in seen:
            seen.add(u.where)
            out.append(u)
    return out
