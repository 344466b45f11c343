"""Checking a tensor-parallel plan against a model, before anything is split (pure: no
communication, so every rank raises the same one-line ValueError before MPI work)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hpctrain.models.dropout import Dropout
from hpctrain.models.layers import LayerStack
from hpctrain.parallel.tensor import hf_plan
from hpctrain.parallel.tensor.loss import is_cross_entropy
from hpctrain.parallel.tensor.styles import match_plan, parse_plan

__all__ = ["TensorOptions", "Split", "check"]

_NEEDS = {"colwise": nn.Linear, "vocab_head": nn.Linear, "rowwise": nn.Linear,
          "vocab_embedding": nn.Embedding, "attention_dropout": Dropout}
_NEED_NAMES = {nn.Linear: "torch.nn.Linear", nn.Embedding: "torch.nn.Embedding",
               Dropout: "hpctrain.models.dropout.Dropout"}


@dataclass(frozen=True)
class TensorOptions:
    """[tensor]: sequence parallel on/off and a plan overriding the model's own."""

    sequence_parallel: bool = False
    plan: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Split:
    """How a parameter is cut over tp: along ``dim``, in ``parts`` equal parts cut alike."""

    dim: int
    parts: int = 1


def _skeleton(model) -> nn.Module:
    if isinstance(model, LayerStack):
        with torch.device("meta"):
            return model.build(range(len(model)))
    return model


def _check(name: str, module: nn.Module, style, n: int) -> None:
    need = _NEEDS.get(style.kind)
    if need is not None and not isinstance(module, need):
        raise ValueError(f"tensor plan: style {style.kind} applies to {_NEED_NAMES[need]}, "
                         f"but module {name!r} is a {type(module).__name__}; give it another "
                         f"style or none")
    where = f"tensor parallel over tp={n}: module {name!r} ({style.kind})"
    if style.kind in ("colwise", "vocab_head"):
        out = module.out_features
        if out % style.parts or (out // style.parts) % n:
            what = f"{out} output features" if style.parts == 1 else \
                f"{out // style.parts} output features per part ({style.parts} parts)"
            raise ValueError(f"{where}: {what} do not split over tp={n}; use sizes divisible "
                             f"by tp")
        if style.heads and style.heads % n:
            raise ValueError(f"{where}: {style.heads} attention heads do not split over "
                             f"tp={n}; use a head count divisible by tp")
    elif style.kind == "rowwise" and module.in_features % n:
        raise ValueError(f"{where}: {module.in_features} input features do not split over "
                         f"tp={n}; use sizes divisible by tp")
    elif style.kind == "vocab_embedding":
        if module.num_embeddings % n:
            raise ValueError(f"{where}: a vocabulary of {module.num_embeddings} does not split "
                             f"over tp={n}; use a vocabulary size divisible by tp (e.g. "
                             f"{-(-module.num_embeddings // n) * n})")
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(f"{where}: padding_idx/max_norm embeddings cannot be split")
    elif style.kind in ("sequence_parallel", "attention_dropout"):
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ValueError(f"{where}: torch's nn.Dropout draws masks that depend on the "
                             f"split; use hpctrain.models.dropout.Dropout")


def _splits(skeleton: nn.Module, styles: dict) -> tuple[dict, int | None]:
    """{state_dict key: Split} of every sliced parameter (aliases of a tied one included)
    and the vocabulary size of a vocab_head (None: none); ValueError for a parameter that
    two styles would cut differently."""
    by_param: dict = {}
    vocab = None
    for name, module in skeleton.named_modules():
        style = styles.get(name)
        if style is None:
            continue
        cuts = {"colwise": ((0, style.parts), (0, style.parts)), "vocab_head": ((0, 1), (0, 1)),
                "rowwise": ((1, 1), None), "vocab_embedding": ((0, 1), None)}.get(style.kind)
        if cuts is None:
            continue
        if style.kind == "vocab_head":
            vocab = module.out_features
        for pname, cut in zip(("weight", "bias"), cuts):
            p = getattr(module, pname, None)
            if p is None or cut is None:
                continue
            split = Split(*cut)
            old = by_param.setdefault(id(p), (split, f"{name}.{pname}"))
            if old[0] != split:
                raise ValueError(f"tensor plan: parameter {name}.{pname} is tied to {old[1]} "
                                 f"but their styles cut it differently; give the tied modules "
                                 f"matching styles (vocab_embedding with vocab_head)")
    splits = {}
    for key, t in skeleton.state_dict(keep_vars=True).items():
        if id(t) in by_param:
            splits[key] = by_param[id(t)][0]
    return splits, vocab


def check(model, options: TensorOptions | None, tp: int, loss_fn=None) -> tuple:
    """Check model's tensor-parallel plan at degree tp (and, given, that loss_fn can run on
    vocabulary-parallel logits); return (styles by module name, splits by state_dict key,
    vocabulary of a vocab_head or None). Pure: every rank raises the same ValueError, before
    any communication."""
    opts = options or TensorOptions()
    # a Hugging Face model also has a tp_plan property: its own styles, translated first
    plan = opts.plan or hf_plan.plan_of(model) or getattr(model, "tp_plan", None) or {}
    if not plan:
        raise ValueError(f"tensor parallel (tp={tp}): the model {type(model).__name__} has no "
                         f"tensor-parallel plan; give one in [tensor.plan] (module-name "
                         f"patterns -> colwise, rowwise, vocab_embedding, vocab_head, "
                         f"sequence_parallel, attention_dropout) or use tp=1")
    skeleton = _skeleton(model)
    styles = match_plan(parse_plan(plan), [n for n, _ in skeleton.named_modules()])
    for name, module in skeleton.named_modules():
        if name in styles:
            _check(name, module, styles[name], tp)
    splits, vocab = _splits(skeleton, styles)
    if loss_fn is not None and vocab is not None and not is_cross_entropy(loss_fn):
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))
        raise ValueError(
            f"tensor parallel: the model's output head is split over the vocabulary "
            f"(vocab_head), so the loss must be the cross-entropy over those logits; the loss "
            f"{name} is not marked as one. Mark a mean token cross-entropy with "
            f"`{name}.cross_entropy = True`, or give the head another style")
    return styles, splits, vocab
