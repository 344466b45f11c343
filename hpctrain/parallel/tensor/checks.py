"""Checking a tensor-parallel plan against a model, before anything is split (pure: no
communication, so every rank raises the same one-line ValueError before MPI work)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.models.dropout import Dropout
from hpctrain.models.layers import LayerStack
from hpctrain.parallel.tensor import hf_plan
from hpctrain.parallel.tensor.layers import is_conv1d
from hpctrain.parallel.tensor.options import TensorOptions
from hpctrain.parallel.tensor.loss import is_cross_entropy
from hpctrain.parallel.tensor.styles import STYLES, match_plan, parse_plan
from hpctrain.registry import SHARDED_FLAVOURS

__all__ = ["TensorOptions", "Split", "check", "check_sharding", "cuts", "model_plan",
           "vocab_rows"]

_NEEDS = {"vocab_head": nn.Linear, "vocab_embedding": nn.Embedding,
          "attention_dropout": Dropout}
_NEED_NAMES = {nn.Linear: "torch.nn.Linear", nn.Embedding: "torch.nn.Embedding",
               Dropout: "hpctrain.models.dropout.Dropout"}
_LINEAR = ("colwise", "rowwise")  # an nn.Linear or a Hugging Face Conv1D


@dataclass(frozen=True)
class Split:
    """How a parameter is cut over tp: along ``dim``, in ``parts`` equal parts cut alike.
    ``padded``: the size of ``dim`` (a vocabulary) when it is padded to a multiple of tp
    instead: rank r holds rows [r c, min((r+1) c, padded)), c = ceil(padded / tp); 0 when
    it divides (every rank holds as many)."""

    dim: int
    parts: int = 1
    padded: int = 0

    def rows(self, rank: int, n: int, size: int) -> tuple[int, int]:
        """(first, count) of the ``size`` entries of ``dim`` (per part) rank holds of n."""
        if not self.padded:
            return rank * (size // n), size // n
        c = -(-size // n)
        first = min(rank * c, size)
        return first, min(c, size - first)


def vocab_rows(vocab: int, tp: int) -> int:
    """Rows of the vocabulary (padded to a multiple of tp) each tp rank holds."""
    return -(-vocab // tp)


def _features(module: nn.Module) -> tuple[int, int]:
    """(output, input) features of an nn.Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[1], module.weight.shape[0]
    return module.out_features, module.in_features


def _skeleton(model) -> nn.Module:
    if isinstance(model, LayerStack):
        with torch.device("meta"):
            return model.build(range(len(model)))
    return model


def _check(name: str, module: nn.Module, style, n: int) -> None:
    need = _NEEDS.get(style.kind)
    where = f"tensor parallel over tp={n}: module {name!r} ({style.kind})"
    if style.kind in _LINEAR and not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise ValueError(f"tensor plan: style {style.kind} applies to torch.nn.Linear or a "
                         f"Hugging Face Conv1D, but module {name!r} is a "
                         f"{type(module).__name__}; give it another style or none")
    if need is not None and not isinstance(module, need):
        raise ValueError(f"tensor plan: style {style.kind} applies to {_NEED_NAMES[need]}, "
                         f"but module {name!r} is a {type(module).__name__}; give it another "
                         f"style or none")
    if style.kind == "colwise":
        out = _features(module)[0]
        if out % style.parts or (out // style.parts) % n:
            what = f"{out} output features" if style.parts == 1 else \
                f"{out // style.parts} output features per part ({style.parts} parts)"
            raise ValueError(f"{where}: {what} do not split over tp={n}; use sizes divisible "
                             f"by tp")
        if style.heads and style.heads % n:
            raise ValueError(f"{where}: {style.heads} attention heads do not split over "
                             f"tp={n}; use a head count divisible by tp")
    elif style.kind == "rowwise" and _features(module)[1] % n:
        raise ValueError(f"{where}: {_features(module)[1]} input features do not split over "
                         f"tp={n}; use sizes divisible by tp")
    elif style.kind in ("vocab_embedding", "vocab_head"):
        vocab = module.num_embeddings if style.kind == "vocab_embedding" else \
            module.out_features
        c = vocab_rows(vocab, n)
        if (n - 1) * c >= vocab:  # the last rank would hold none of it
            raise ValueError(f"{where}: a vocabulary of {vocab} padded to a multiple of tp "
                             f"({c} rows per rank) leaves the last of the tp={n} ranks no "
                             f"rows; use a smaller tp or a larger vocabulary")
        if style.kind == "vocab_embedding" and module.max_norm is not None:
            raise ValueError(f"{where}: a max_norm embedding renormalises the rows it looks "
                             f"up, which a split cannot do as one process; set max_norm=None "
                             f"or give it no style")
    elif style.kind in ("sequence_parallel", "attention_dropout"):
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ValueError(f"{where}: torch's nn.Dropout draws masks that depend on the "
                             f"split; use hpctrain.models.dropout.Dropout")
    elif style.kind == "per_rank":
        for attr in style.divide:
            value = getattr(module, attr, None)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}: {type(module).__name__} has no integer attribute "
                                 f"{attr!r} (got {value!r}); name the attributes that count "
                                 f"what tp splits (heads, features) in 'divide'")
            if value % n:
                raise ValueError(f"{where}: {attr} = {value} does not split over tp={n}; use "
                                 f"sizes divisible by tp")


def cuts(style, module: nn.Module, tp: int) -> dict:
    """{parameter name: Split} of what ``style`` cuts of ``module`` at degree tp."""
    kind, conv = style.kind, is_conv1d(module)
    if kind == "colwise":  # output features: a Conv1D's weight is (in, out)
        return {"weight": Split(1 if conv else 0, style.parts), "bias": Split(0, style.parts)}
    if kind == "rowwise":  # input features; the bias is added once, whole
        return {"weight": Split(0 if conv else 1)}
    if kind in ("vocab_head", "vocab_embedding"):
        vocab = module.weight.shape[0]
        padded = vocab if vocab % tp else 0
        return {"weight": Split(0, padded=padded), "bias": Split(0, padded=padded)}
    return {}


def _splits(skeleton: nn.Module, styles: dict, tp: int) -> tuple[dict, int | None]:
    """{state_dict key: Split} of every sliced parameter (aliases of a tied one included)
    and the vocabulary size of a vocab_head (None: none); ValueError for a parameter that
    two styles would cut differently."""
    by_param: dict = {}
    vocab = None
    for name, module in skeleton.named_modules():
        style = styles.get(name)
        if style is None:
            continue
        if style.kind == "vocab_head":
            vocab = module.out_features
        for pname, split in cuts(style, module, tp).items():
            p = getattr(module, pname, None)
            if p is None:
                continue
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


def model_plan(model) -> dict:
    """The plan a model declares ({} if none): a Hugging Face model's own (translated; GPT-2,
    which has none, gets hf_plan's), else its ``tp_plan``. A LayerStack split from a built
    model (models/chain.py) declares what that model does."""
    source = getattr(model, "source", None) if isinstance(model, LayerStack) else None
    for m in (model, source) if source is not None else (model,):
        # a Hugging Face model also has a tp_plan property: its own styles, translated first
        plan = hf_plan.plan_of(m) or getattr(m, "tp_plan", None)
        if plan:
            return dict(plan)
    return {}


def _from_hugging_face(model) -> bool:
    """Whether model's own plan is a Hugging Face model's (translated by hf_plan)."""
    source = getattr(model, "source", None) if isinstance(model, LayerStack) else None
    return any(hf_plan.plan_of(m) for m in (model, source) if m is not None)


# dp flavours that shard flat buffers of the tp-local parameters over dp
_SHARDED = SHARDED_FLAVOURS


def check_sharding(splits: dict, tp: int, flavour: str, dp: int) -> None:
    """ValueError when the dp flavour cannot shard the split: the sharded flavours lay the
    tp-local parameters out in flat buffers that must line up across the tp ranks (their
    replicated parameters are checked and summed over tp range by range), which a
    vocabulary padded to a multiple of tp, held unevenly, breaks."""
    padded = sorted((k, s.padded) for k, s in splits.items() if s.padded)
    if not padded or dp <= 1 or flavour not in _SHARDED:
        return
    key, vocab = padded[0]
    c = vocab_rows(vocab, tp)
    raise ValueError(f"tensor parallel over tp={tp} with {flavour} over dp={dp}: the vocabulary "
                     f"of {vocab} ({key}) is padded to a multiple of tp, so the tp ranks hold "
                     f"{c} and {vocab - (tp - 1) * c} rows and {flavour}'s flat shards would "
                     f"not line up across them; use a vocabulary divisible by tp (e.g. "
                     f"{c * tp}) or the dp flavour ddp")


def check(model, options: TensorOptions | None, tp: int, loss_fn=None, flavour: str = "",
          dp: int = 1) -> tuple:
    """Check model's tensor-parallel plan at degree tp (and, given, that loss_fn can run on
    vocabulary-parallel logits, and that the dp ``flavour`` over ``dp`` replicas can shard
    it); return (styles by module name, splits by state_dict key, vocabulary of a
    vocab_head or None). Pure: every rank raises the same ValueError, before any
    communication."""
    opts = options or TensorOptions()
    plan = opts.plan or model_plan(model)
    if not plan:
        raise ValueError(f"tensor parallel (tp={tp}): the model {type(model).__name__} has no "
                         f"tensor-parallel plan; give one in [tensor.plan] (module-name "
                         f"patterns -> {', '.join(STYLES)}) or use tp=1")
    skeleton = _skeleton(model)
    styles = match_plan(parse_plan(plan), [n for n, _ in skeleton.named_modules()])
    for name, module in skeleton.named_modules():
        if name in styles:
            _check(name, module, styles[name], tp)
    if opts.sequence_parallel and not opts.plan and _from_hugging_face(model):
        # their plans mark no norm region, and their positions come from the input's length
        raise ValueError(f"tensor parallel over tp={tp}: tensor.sequence_parallel = true is not "
                         f"supported with the plan of a Hugging Face model "
                         f"({type(model).__name__}): it marks no 'sequence_parallel' region "
                         f"(norms, dropout, positions); set tensor.sequence_parallel = false")
    splits, vocab = _splits(skeleton, styles, tp)
    if loss_fn is not None and vocab is not None and not is_cross_entropy(loss_fn):
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))
        raise ValueError(
            f"tensor parallel: the model's output head is split over the vocabulary "
            f"(vocab_head), so the loss must be the cross-entropy over those logits; the loss "
            f"{name} is not marked as one. Mark a mean token cross-entropy with "
            f"`{name}.cross_entropy = True`, or give the head another style")
    check_sharding(splits, tp, flavour, dp)
    return styles, splits, vocab
