"""What a run needs after the tensor-parallel split: the tp group, the loss over
vocabulary-parallel logits, the samples a rank reads (as the executor of a tp x dp run) and
the whole tensors put back together from the tp slices."""

from __future__ import annotations

import torch

from hpctrain.parallel.tensor.checks import Split, vocab_rows
from hpctrain.parallel.tensor.loss import is_cross_entropy, vocab_parallel_cross_entropy

__all__ = ["TensorParallel"]


class TensorParallel:
    """What the run needs to know after the split: the tp group, which state_dict keys are
    slices and how (``splits``), and the vocabulary slice of the output head (the loss).
    As the executor of a tp x dp run it also says which samples this rank reads."""

    def __init__(self, tp, sequence_parallel: bool, splits: dict, vocab: int | None,
                 dp_rank: int, dp_size: int):
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.splits, self.vocab = splits, vocab
        self.dp_rank, self.dp_size = dp_rank, dp_size

    # -- the loss and the reported loss --
    def adapt_loss(self, loss_fn):
        """The loss to run on this rank's logits (vocab-parallel cross-entropy when the
        head's vocabulary is split; ``check`` has made sure loss_fn is a cross-entropy)."""
        if self.vocab is None:
            return loss_fn
        if not is_cross_entropy(loss_fn):
            raise ValueError(f"tensor parallel: loss {loss_fn!r} cannot run on "
                             f"vocabulary-parallel logits (see transform.check)")
        # rank r's logits are the ids [r c, r c + its rows) of the padded vocabulary
        tp = self.tp
        start = min(tp.rank * vocab_rows(self.vocab, tp.size), self.vocab)

        def loss(output, targets):  # a Hugging Face output holds its logits
            logits = getattr(output, "logits", output)
            return vocab_parallel_cross_entropy(logits, targets, tp, start)
        return loss

    # -- executor of a tp x dp run (the pipeline is the executor under pp) --
    def data_shard(self, world) -> tuple[int, int]:
        """The tp ranks of a replica read the same samples (local)."""
        return self.dp_rank, self.dp_size

    def load_batch(self, dataset, indices):
        from hpctrain.data.sampler import collate

        return collate(dataset, indices)

    def forward_backward(self, dp_part, micro_batches, loss_fn, precision) -> float:
        """The flavour's own loop: every tp rank runs the whole micro-batch (collective)."""
        return dp_part.forward_backward(micro_batches, loss_fn, precision)

    def forward_loss(self, dp_part, micro_batches, loss_fn, precision) -> float:
        """Evaluation: every tp rank forwards the whole micro-batch (collective)."""
        return dp_part.forward_loss(micro_batches, loss_fn, precision)

    # -- whole tensors --
    def assemble(self, state: dict) -> dict:
        """state with every tp slice replaced by the whole tensor (collective over tp;
        every tp rank passes the same keys in the same order)."""
        out = {}
        done = {}
        for key, t in state.items():
            split = self.splits.get(key)
            if split is None or not torch.is_tensor(t):
                out[key] = t
                continue
            if id(t) not in done:
                done[id(t)] = _assemble(t, split, self.tp)
            out[key] = done[id(t)]
        return out


def _assemble(t: torch.Tensor, split: Split, tp) -> torch.Tensor:
    if split.padded:  # uneven rows: each rank's padded to ceil(V/tp), the padding cut off
        d, c = split.dim, vocab_rows(split.padded, tp.size)
        local = t.detach().movedim(d, 0)
        full = local.new_zeros((c,) + tuple(local.shape[1:]))
        full[:local.shape[0]] = local
        pieces = tp.allgather(full.reshape(1, -1).contiguous())
        whole = torch.cat([p.reshape(full.shape) for p in pieces])[:split.padded]
        return whole.movedim(0, d).contiguous()
    pieces = tp.allgather(t.detach().reshape(1, -1).contiguous())
    d, shape = split.dim, tuple(t.shape)
    per = shape[d] // split.parts
    parts = [p.reshape(shape[:d] + (split.parts, per) + shape[d + 1:]) for p in pieces]
    whole = torch.cat(parts, dim=d + 1)
    return whole.reshape(shape[:d] + (shape[d] * tp.size,) + shape[d + 1:])
