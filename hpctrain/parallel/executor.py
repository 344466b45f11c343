"""What a model-parallel transform hands the orchestrator: an Executor.

A transform (``parallel/<name>/``'s ``prepare``) splits the model over its mesh dimension
and returns the part this rank keeps plus an Executor: how a step runs over the split
(forward and backward of the step's micro-batches, evaluation) and which samples, and which
part of each, this rank reads. The data-parallel flavour then keeps the replicas in step;
``Composed`` (orchestrator.py) is the two together, the object the trainer drives.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

__all__ = ["Executor", "OPTIONAL_HOOKS"]


@runtime_checkable
class Executor(Protocol):
    """Runs the steps of a split model. ``flavour``: the data-parallel flavour's
    Parallelized over the part this rank keeps (its backward and gradients)."""

    def forward_backward(self, flavour, micro_batches: Iterable, loss_fn, precision) -> float:
        """Forward and backward over one step's ``(x, y, weight)`` micro-batches; the
        weighted loss this rank reports (collective)."""

    def forward_loss(self, flavour, micro_batches: Iterable, loss_fn, precision) -> float:
        """``forward_backward`` without the backward (evaluation; collective)."""

    def data_shard(self, world) -> tuple[int, int]:
        """(index, count) of this rank's share of each micro-batch's samples (local)."""

    def load_batch(self, dataset, indices):
        """Collate this rank's part of the samples ``indices`` (local)."""


#: Hooks an Executor may add where the whole model's naming differs from the flavour's
#: (the pipeline's stages): ``state_entries(flavour)``, ``state_meta(flavour)``,
#: ``memory_report(flavour)``, ``full_state(flavour)`` and ``name_of`` (a stage
#: parameter's name in the whole model).
OPTIONAL_HOOKS = ("state_entries", "state_meta", "memory_report", "full_state", "name_of")
