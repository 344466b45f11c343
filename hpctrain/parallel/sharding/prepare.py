"""What zero and fsdp do to a model before flattening it into units."""

from __future__ import annotations

import torch
from torch import nn

from hpctrain.parallel.deferred import is_placeholder, to_device

__all__ = ["broadcast_state", "prepare_model"]


def broadcast_state(model: nn.Module, comm) -> None:
    """Parameters and buffers from rank 0, so a model with random init agrees everywhere."""
    seen = set()
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            # deferred-init placeholders: every rank fills them with the same values
            if id(t) not in seen and t.numel() and not is_placeholder(t):
                seen.add(id(t))
                comm.broadcast(t.detach(), root=0)


def prepare_model(model: nn.Module, world, opts, groups, units=None):
    """What zero and fsdp do before flattening: pick the units (the options' auto-wrap
    policy, or ``units`` a model-parallel transform named), move the model to the device,
    make BatchNorm global over ``groups.batch`` (opts.sync_batchnorm) and start every
    replica from rank 0's values. Returns (model, unit specs, frozen (name, param) pairs)."""
    from hpctrain.parallel.sync_batchnorm import convert_sync_batchnorm
    from hpctrain.parallel.units import partition_modules, rebind, wrapped_modules

    wrapped = [] if units is not None else wrapped_modules(model, opts)  # a bad policy fails here
    to_device(model, world.device)
    if opts.sync_batchnorm:  # batch statistics of the global batch, as in one process
        model = convert_sync_batchnorm(model, groups.batch)
    broadcast_state(model, groups.batch)
    if units is not None:
        frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        return model, units, frozen
    specs, frozen = partition_modules(model, rebind(model, wrapped))
    return model, specs, frozen
