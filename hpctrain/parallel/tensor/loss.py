"""Cross-entropy over vocabulary-parallel logits: no rank ever holds the full logits.

Each tp rank holds the logits of its vocabulary slice; the max, the sum of exponentials and
the target logit are reduced over tp (three small all-reduces of one value per token), and
the gradient, softmax minus one-hot, is formed locally (Megatron-LM's
_VocabParallelCrossEntropy)."""

from __future__ import annotations

import torch

__all__ = ["vocab_parallel_cross_entropy", "is_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, comm, vocab_start):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays
        n_local = logits.shape[-1]
        peak = logits.max(dim=-1).values
        comm.allreduce(peak, op="max")
        shifted = logits - peak.unsqueeze(-1)
        local = targets - vocab_start
        outside = (local < 0) | (local >= n_local)
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        comm.allreduce(sums)
        loss = sums[0].log() - sums[1]
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local, outside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = grad.view(-1, grad.shape[-1])
        hit = (~outside).view(-1).nonzero().squeeze(-1)
        rows[hit, local.view(-1)[hit]] -= 1.0
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm, vocab_start: int,
                                 ignore_index: int = -100):
    """Mean cross-entropy of (..., V/tp) logit slices (vocabulary from ``vocab_start``)
    against (...) targets over the whole vocabulary, over the targets other than
    ``ignore_index`` (padding, as torch's cross_entropy; a batch with none gives 0, still a
    function of the logits); equal on every tp rank (collective)."""
    flat = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    keep = targets != ignore_index
    if bool(keep.all()):
        return _VocabParallelCE.apply(flat, targets, comm, int(vocab_start)).mean()
    # An ignored target becomes id 0 for the kernel; its loss (and gradient) is masked out.
    loss = _VocabParallelCE.apply(flat, targets.masked_fill(~keep, 0), comm, int(vocab_start))
    return (loss * keep).sum() / keep.sum().clamp(min=1)


def is_cross_entropy(loss_fn) -> bool:
    """Whether loss_fn is marked (``loss_fn.cross_entropy = True``) as the mean
    cross-entropy of (logits, targets) over the logits' last dim, as models.gpt.lm_loss is."""
    return getattr(loss_fn, "cross_entropy", False) is True
