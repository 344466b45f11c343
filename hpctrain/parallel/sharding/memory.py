"""The sharded engine's memory report (``ShardMemory``): the bytes each rank holds, the
transient buffers measured, and beside each the budget its option sets."""

from __future__ import annotations

import torch

from hpctrain.parallel.sharding.reduction import reduction_buffer_bytes
from hpctrain.parallel.storage import nbytes

__all__ = ["ShardMemory"]


class ShardMemory:
    """ShardedModel's memory report (a mixin: the engine holds ``plan``, ``units``,
    ``schedule``, ``_reductions`` and the measured peaks)."""

    def memory_report(self) -> dict:
        """Bytes this rank holds for trainable params and optimizer state, the gradients alive
        at the last step, the largest transient buffers and the frozen (replicated) params;
        local. Transients, each measured and beside it the budget its option sets: the
        gathered units (``peak_gathered``; ``largest_gathered_unit`` + ``prefetch_buffer``, the
        largest unit ``allgather_bucket_size`` lets backward prefetch), and the overlapped
        reduction's buffers (``reduce_buffers``: the piece buffers alive at once plus what the
        backend stages to receive the pieces in flight; ``reduce_buffers_limit`` for the
        ``reduce_bucket_size``; zero1 reduce-scatters each unit's persistent gradient buffer
        whole at the step instead: the result and the MPI ring's two chunks, three shards of
        the largest unit, whatever the bucket). Beside them, where gradients are reduced
        during backward: ``unit_grads``, the most full-gradient bytes alive when a unit's
        reduction starts (its own, autograd's output, until the reduction frees them), and
        ``unit_grads_limit``, the largest unit's (plus the root unit's, which wait for the
        embedding's; every unit's under gradient accumulation, kept from the first
        micro-batch to the last one's reduction)."""
        on_demand = self.plan.on_demand
        params = nbytes([u.full for u in self.units if not on_demand] +
                        [u.shard for u in self.units])
        optim = nbytes([v for st in self.optimizer.state.values() for v in st.values()
                        if torch.is_tensor(v)])
        gathered = max(u.full_bytes() for u in self.units) if on_demand else 0
        red, n = self._reductions, self.comm.size
        overlapped = not self.plan.persistent_grads and n > 1
        staged = red.peak_inflight * (n - 1) // n
        if overlapped:
            limit = reduction_buffer_bytes(red.bucket, n)
        elif self.plan.persistent_grads and n > 1:
            limit = max(3 * u.shard_numel * u.full.element_size() for u in self.units)
        else:
            limit = 0
        return {"stage": self.plan.stage, "strategy": self.name, "world_size": self.world.size,
                "shard_group": self.comm.size,
                "replicas": self.replicate.size if self.replicate is not None else 1,
                "partial_groups": [c.size for c in self.partial] +
                                  sorted({c.size for st in self._states for c, _ in st.partial}),
                "trainable_numel": sum(u.numel for u in self.units),
                "padded_numel": sum(u.padded for u in self.units),
                "params": params, "grads": self._grad_bytes, "optimizer": optim,
                "largest_gathered_unit": gathered,
                "peak_gathered": self.schedule.peak_gathered if self.schedule else 0,
                "prefetch_buffer": self.schedule.prefetch_buffer if self.schedule else 0,
                "peak_prefetched": self.schedule.peak_prefetched if self.schedule else 0,
                "allgather_bucket_size": self.schedule.prefetch_bytes
                                         if self.schedule and self.schedule.prefetch else 0,
                "transient_grad_bucket": red.peak_bytes,
                "reduce_bucket_size": red.bucket if overlapped else 0,
                "reduce_buffers": red.peak_bytes + staged + self._step_buffers,
                "reduce_buffers_limit": limit,
                "unit_grads": self._peak_unit_grads,
                "unit_grads_limit": self._unit_grads_limit(),
                "frozen_params": nbytes([p for _, p in self.frozen])}

    def _unit_grads_limit(self) -> int:
        """Full-gradient bytes alive at once where gradients are reduced during backward:
        the largest unit's, plus the root unit's (the model's own parameters, embeddings
        and a tied head: complete, so reduced, only when backward reaches the embedding);
        under gradient accumulation every unit's (the earlier micro-batches accumulate
        full gradients locally)."""
        if self.plan.persistent_grads:
            return 0
        size = {id(u): u.numel * u.full.element_size() for u in self.units}
        if self.plan.grad_accum > 1:
            return sum(size.values())
        root = sum(size[id(u)] for u in self.units if u.name == "<root>")
        return root + max((size[id(u)] for u in self.units if u.name != "<root>"), default=0)
