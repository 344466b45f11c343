"""Swap a model's spatial layers for their domain-parallel versions (same parameter names)."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from hpctrain.parallel.domain.halo import DomainGrid
from hpctrain.parallel.domain.groupnorm import DomainGroupNorm
from hpctrain.parallel.domain.layers import DomainConv, DomainPool, domain_upsample
from hpctrain.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from hpctrain.runtime.comm import Communicator

__all__ = ["to_domain"]

_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def to_domain(module: nn.Module, grid: DomainGrid, batch_comm: Communicator,
              overlap: bool = False, name: str = "") -> nn.Module:
    """Return module with convs, pools, upsampling and norms made domain parallel.

    BatchNorm statistics are reduced over ``batch_comm`` (every rank holding part of the
    global batch: the domain group times dp); GroupNorm's over the domain group only.
    Other layers stay as they are: what they compute (point by point, a global reduction,
    or a Linear over a tile, refused) is decided op by op in the forward (functional.py).
    ``name``: the module's qualified name in the model, for errors.
    """
    try:
        converted = _convert(module, grid, batch_comm, overlap)
    except ValueError as exc:  # the layer's own check (a padding mode, ceil_mode): name it
        if not name:
            raise
        raise ValueError(f"layer {name!r} ({type(module).__name__}): {exc}") from None
    if converted is not None:
        return converted
    for child_name, child in module.named_children():
        new = to_domain(child, grid, batch_comm, overlap,
                        f"{name}.{child_name}" if name else child_name)
        if new is not child:
            setattr(module, child_name, new)
    return module


def _convert(module: nn.Module, grid: DomainGrid, batch_comm: Communicator, overlap: bool):
    """The domain-parallel version of one spatial layer, or None if it is not one."""
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        return DomainConv(module, grid, overlap)
    if isinstance(module, _POOLS):
        return DomainPool(module, grid, overlap)
    if isinstance(module, nn.Upsample):
        return domain_upsample(module, grid, overlap)
    if isinstance(module, nn.GroupNorm):
        return DomainGroupNorm(module, grid.comm)
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        return convert_sync_batchnorm(module, batch_comm)
    return None
