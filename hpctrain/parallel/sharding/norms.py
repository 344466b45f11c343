"""The sharded engine's norms and non-finite path (``ShardNorms``): global norms over the
shards (each element counted once), clipping, the scaler's found-inf agreed over the job,
and the parameters whose owned gradient elements are not finite."""

from __future__ import annotations

import math

import torch

from hpctrain.parallel.placement import global_norm

__all__ = ["ShardNorms"]


class ShardNorms:
    """ShardedModel's norms (a mixin: the engine holds ``units``, ``frozen``, ``_states`` and
    ``_placement``)."""

    def param_norm(self) -> float:
        """Global L2 norm of all parameters (each element once); collective."""
        with torch.no_grad():
            return global_norm([t for st in self._states for t in st.terms(st.unit.shard)] +
                               [(p, self._placement(p).norm_weight) for _, p in self.frozen],
                               self.job_comm)

    def _agree_on_inf(self, scaler) -> None:
        # Each rank unscaled only its shard; an inf in another rank's shard must skip the
        # step here too. (GradScaler keeps found_inf per optimizer in this private table.)
        found = scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        for t in found.values():
            if t.device == self.world.comm.device:
                self.world.comm.allreduce(t, op="max")
            else:  # offloaded shards are unscaled on the host
                self.world.host.allreduce(t, op="max")

    def _grad_norm(self) -> float:
        # Each shard's squares weighted by its placement, summed over the job: every element
        # counts once, over shards, replicas, domain tiles, stages and tied copies alike.
        return global_norm([t for st in self._states if st.unit.shard.grad is not None
                            for t in st.terms(st.unit.shard.grad)], self.job_comm)

    def buffer_norm(self) -> float:
        """Global L2 norm of the floating buffers; collective."""
        with torch.no_grad():
            return global_norm([(b, self._placement(b).norm_weight) for b in self.model.buffers()
                                if b.is_floating_point()], self.job_comm)

    def _clip(self, max_norm: float) -> float:
        norm = self._grad_norm()
        if math.isfinite(norm) and norm > max_norm:
            for u in self.units:
                if u.shard.grad is not None:
                    u.shard.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _nonfinite_grads(self) -> tuple[list, list]:
        """As Parallelized's, from the gradient shards: a parameter is named when an element
        of it that this rank owns is not finite."""
        names, bad = [], []
        for st in self._states:
            g, u = st.unit.shard.grad, st.unit
            finite = g is None or bool(torch.isfinite(g).all())
            for s in u.slots:
                names.append(s.name)
                if not finite and any(not bool(torch.isfinite(g[a:b]).all())
                                      for a, b in u.owned_ranges([s])):
                    bad.append(s.name)
        return names, bad
