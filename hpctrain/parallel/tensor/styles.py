"""The tensor-parallel plan: module-name patterns mapped to styles, checked before anything
is split (pure, no communication: every rank finds the same errors).

A plan comes from the model (``model.tp_plan``, as the built-in gpt has; a LayerStack's
``tp_plan``) or from the config (``[tensor.plan]``), e.g.::

    [tensor.plan]
    "blocks.*.attn.qkv" = { style = "colwise", parts = 3, heads = 4 }
    "blocks.*.attn.proj" = "rowwise"
    "tok_emb" = "vocab_embedding"

``*`` matches one component of a module path. Styles:

- ``colwise``: an nn.Linear whose output features are split (``parts``: a fused layer of
  equal parts, each split alike, e.g. qkv = 3; ``heads``: the heads per part, split whole);
- ``rowwise``: an nn.Linear whose input features are split (its bias is replicated);
- ``vocab_embedding``: an nn.Embedding whose vocabulary rows are split;
- ``vocab_head``: the output nn.Linear over the vocabulary, rows split; the logits stay
  split and the loss becomes the vocabulary-parallel cross-entropy;
- ``sequence_parallel``: a module run on sequence chunks when sequence parallel is on
  (LayerNorm, residual dropout, the position embedding, whose output is then cut);
- ``attention_dropout``: a models.dropout.Dropout on attention probabilities (batch, heads,
  query, key): its mask is cut to this rank's heads;
- ``per_rank``: a module whose integer attributes named in ``divide`` count what the split
  cuts (an attention's heads, the width it splits its fused projection at): each rank's are
  the whole model's / tp, e.g. Hugging Face GPT-2's
  ``{ style = "per_rank", divide = ["split_size", "num_heads"] }``.

``colwise`` and ``rowwise`` also take a Hugging Face ``Conv1D`` (GPT-2's projections: a
Linear whose weight is stored transposed, (in, out)). The vocabulary of ``vocab_embedding``
and ``vocab_head`` need not divide by tp: it is padded to a multiple of tp, as Megatron-LM's
``make-vocab-size-divisible-by``, and rank r holds rows [r c, (r+1) c) of the padded
vocabulary (c = ceil(vocab / tp)) that exist: the padding is held by no rank, so it has no
logits, no gradient and no place in a checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["STYLES", "Style", "parse_plan", "match_plan"]

STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head", "sequence_parallel",
          "attention_dropout", "per_rank")


@dataclass(frozen=True)
class Style:
    kind: str
    parts: int = 1
    heads: int = 0
    divide: tuple = ()


def _style(pattern: str, value) -> Style:
    where = f"tensor plan entry {pattern!r}"
    if isinstance(value, str):
        value = {"style": value}
    if not isinstance(value, dict) or "style" not in value:
        raise ValueError(f"{where}: expected a style name or a table with 'style' (one of "
                         f"{', '.join(STYLES)}), got {value!r}")
    unknown = set(value) - {"style", "parts", "heads", "divide"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; a style "
                         f"takes 'parts' and 'heads' (colwise only) or 'divide' (per_rank "
                         f"only)")
    kind = value["style"]
    if kind not in STYLES:
        raise ValueError(f"{where}: unknown style {kind!r}; expected one of {', '.join(STYLES)}")
    parts, heads = value.get("parts", 1), value.get("heads", 0)
    if not (isinstance(parts, int) and parts >= 1 and isinstance(heads, int) and heads >= 0):
        raise ValueError(f"{where}: parts must be an integer >= 1 and heads >= 0, got "
                         f"parts={parts!r} heads={heads!r}")
    if kind != "colwise" and (parts != 1 or heads):
        raise ValueError(f"{where}: parts/heads apply to the colwise style only, not {kind}")
    divide = value.get("divide", [])
    if kind == "per_rank" and not (isinstance(divide, (list, tuple)) and divide and
                                   all(isinstance(a, str) and a for a in divide)):
        raise ValueError(f"{where}: per_rank needs 'divide', a list of the module's integer "
                         f"attributes that tp divides (e.g. [\"num_heads\"]), got {divide!r}")
    if kind != "per_rank" and divide:
        raise ValueError(f"{where}: divide applies to the per_rank style only, not {kind}")
    return Style(kind, parts, heads, tuple(divide))


def _regex(pattern: str) -> re.Pattern:
    parts = [r"[^.]+" if p == "*" else re.escape(p).replace(r"\*", r"[^.]*")
             for p in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def parse_plan(plan) -> list[tuple[str, re.Pattern, Style]]:
    """(pattern, its regex, Style) for each entry of a plan mapping (ValueError: which entry
    and why)."""
    if not isinstance(plan, dict):
        raise ValueError(f"tensor plan must map module-name patterns to styles, got "
                         f"{type(plan).__name__}")
    return [(p, _regex(p), _style(p, v)) for p, v in plan.items()]


def match_plan(entries, module_names) -> dict[str, Style]:
    """{module name: Style} of every module a pattern matches (ValueError: a pattern that
    matches no module, or a module that two patterns match)."""
    out, by = {}, {}
    for pattern, rx, style in entries:
        hits = [n for n in module_names if rx.match(n)]
        if not hits:
            raise ValueError(f"tensor plan pattern {pattern!r} matches no module of the model; "
                             f"module names look like {', '.join(list(module_names)[1:4])}")
        for n in hits:
            if n in out:
                raise ValueError(f"module {n!r} is matched by tensor plan patterns "
                                 f"{by[n]!r} and {pattern!r}; give it one style")
            out[n], by[n] = style, pattern
    return out
