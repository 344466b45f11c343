"""Batch norm whose statistics are those of the GLOBAL batch (summed over a communicator).

Data parallel splits a batch over ranks; plain BatchNorm would normalise each rank's slice
by its own statistics and diverge from single-process training. Here the per-channel sums
are all-reduced (two passes: mean, then centred squares, for fp32 accuracy) so every rank
normalises with, and updates its running stats from, the statistics of the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hpctrain.parallel.functional import all_reduce_sum
from hpctrain.parallel.placement import carry_placements
from hpctrain.runtime.comm import Communicator

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for BatchNorm1d/2d/3d; same parameter and buffer names (checkpoints match)."""

    def __init__(self, num_features, comm: Communicator, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.comm = comm

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input, got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        # Statistics in at least fp32 (autocast may hand us bf16/fp16 activations).
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = torch.tensor([x.numel() / max(x.shape[1], 1)], dtype=xf.dtype, device=x.device)
        stats = all_reduce_sum(torch.cat([xf.sum(dims), count]), self.comm)
        n = stats[-1]
        mean = stats[:-1] / n
        centred = xf - mean.view(shape)
        var = all_reduce_sum(centred.pow(2).sum(dims), self.comm) / n
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), float(n.detach()))
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean, var, n: float) -> None:
        self.num_batches_tracked.add_(1)
        momentum = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)


def convert_sync_batchnorm(module: nn.Module, comm: Communicator) -> nn.Module:
    """Replace every BatchNorm*d in module (recursively) by a SyncBatchNorm over comm."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        ref = next((t for t in (module.weight, module.running_mean) if t is not None), None)
        like = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
        sync = SyncBatchNorm(module.num_features, comm, module.eps, module.momentum, module.affine,
                             module.track_running_stats, **like)
        sync.load_state_dict(module.state_dict())
        carry_placements(module, sync)
        sync.train(module.training)
        for name in ("weight", "bias"):  # keep requires_grad (frozen affine stays frozen)
            if getattr(module, name, None) is not None:
                getattr(sync, name).requires_grad_(getattr(module, name).requires_grad)
        return sync
    for name, child in module.named_children():
        new = convert_sync_batchnorm(child, comm)
        if new is not child:
            setattr(module, name, new)
    return module
