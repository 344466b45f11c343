"""What a plan does with a model's dropout: equal masks where the plan promises one process's
trajectory, per-rank masks said out loud where it does not.

Tensor parallel reproduces one process's masks only through hpctrain's Dropout (the whole
activation's mask drawn alike on every tp rank, each keeping its slice: models/dropout.py);
torch's dropout there (a module, or functional inside an attention function: Hugging Face's
``attention_dropout``/``attn_pdrop``) draws masks over each rank's heads. The pipeline runs
each micro-batch in pieces, each stage on its own RNG stream, so no dropout there gives one
process's masks. Both are refused unless ``train.per_rank_dropout`` accepts them; the
data-parallel flavours draw masks per rank for each rank's samples (documented), which the
log says once.
"""

from __future__ import annotations

import torch

from hpctrain.data.sampler import collate
from hpctrain.data.structure import to_device
from hpctrain.errors import UsageError
from hpctrain.models.dropout import DropoutUse, find_dropout
from hpctrain.models.layers import LayerStack, StackModel

__all__ = ["check_dropout", "dropout_note"]


def check_dropout(plan, model, dataset, per_rank: bool) -> str | None:
    """Find the dropout of ``model`` (traced on the data set's first samples under a tensor
    or pipeline plan, where it decides) and return ``dropout_note``'s line or raise its
    UsageError. No communication."""
    traced = (plan.tensor or plan.pipeline) and dataset is not None and len(dataset) > 0
    if isinstance(model, LayerStack):
        with torch.device("meta"):  # a built-in's layers build nothing real here
            whole = model.build(range(len(model)))
        if any(p.is_meta for p in whole.parameters()):
            return dropout_note(plan, find_dropout(whole), per_rank)
        # the layers of an already built model (models/chain.py): traced through them
        model = StackModel(model)
    sample = None
    if traced:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        sample = to_device(collate(dataset, range(min(2, len(dataset))))[0], device)
    return dropout_note(plan, find_dropout(model, sample), per_rank)


def _listed(uses: list[DropoutUse]) -> str:
    shown = "; ".join(f"{u.where} p={u.p:g}" for u in uses[:4])
    return shown + (f"; and {len(uses) - 4} more" if len(uses) > 4 else "")


def dropout_note(plan, uses: list[DropoutUse], per_rank: bool) -> str | None:
    """The rank-0 line to print about ``uses`` under ``plan`` (None: nothing to say);
    UsageError, one line naming the dropout and the fix, for a tensor or pipeline plan whose
    masks would not be one process's (pure: every rank raises alike, before any collective)."""
    if not uses:
        return None
    inexact = [u for u in uses if plan.pipeline or not u.exact]
    split = "the pipeline" if plan.pipeline else "tensor parallel"
    if (plan.tensor or plan.pipeline) and inexact and not per_rank:
        why = ("runs each micro-batch in pieces, stage by stage, so no dropout mask is one "
               "process's" if plan.pipeline else
               "keeps one process's masks only with hpctrain.models.dropout.Dropout (torch's "
               "dropout draws them over each rank's heads)")
        raise UsageError(f"plan {plan.name!r}: the model has dropout > 0 ({_listed(inexact)}), "
                         f"and {split} {why}; set it to 0 (e.g. config.attention_dropout "
                         f"= 0.0), or accept per-rank masks with train.per_rank_dropout = true")
    if (plan.tensor or plan.pipeline) and inexact:  # accepted: train.per_rank_dropout
        return (f"hpctrain: note: dropout > 0 ({_listed(inexact)}) under {split}: masks "
                f"are drawn per rank and piece (train.per_rank_dropout = true), so the run "
                f"follows one process in distribution, not step by step")
    if plan.dp == 1 and not plan.domain:
        return None  # one process's masks (tensor parallel through hpctrain's Dropout)
    return (f"hpctrain: note: dropout > 0 ({_listed(uses)}): each data-parallel rank draws "
            f"the masks of its own samples, so runs at different world sizes agree in "
            f"distribution, not step by step")
