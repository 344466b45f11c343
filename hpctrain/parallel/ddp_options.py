"""[ddp]: the options of Horovod data parallel (pure: the config table itself)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.option import given, option

__all__ = ["DDPOptions"]


@dataclass
class DDPOptions:
    """Horovod knobs: fp16 gradient compression, tensor fusion, micro-batches per step, and
    whether BatchNorm layers use global-batch statistics."""

    fp16_compression: bool = option(False, "compress gradients to fp16 for the all-reduce")
    fusion_threshold_mb: float = option(128.0, "Horovod tensor fusion buffer "
                                        "(HOROVOD_FUSION_THRESHOLD)", min=0.0)
    cycle_time_ms: float = option(1.0, "Horovod cycle time (HOROVOD_CYCLE_TIME)", min=0.0)
    sync_batchnorm: bool = option(True, "BatchNorm statistics over the global batch (all "
                                  "ranks)")
    grad_accum: int = given(1, "micro-batches per optimizer step (train.grad_accum)")
