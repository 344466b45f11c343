"""The orchestrator's config reading: typed strategy options and the optimizer factory."""

from __future__ import annotations

import torch

from hpctrain.config import Config, TrainSection

__all__ = ["make_optimizer_factory", "strategy_options"]


def make_optimizer_factory(t: TrainSection):
    """Return params -> optimizer for the configured optimizer (strategies call it)."""
    def make(params):
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        if t.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        raise ValueError(f"optimizer {t.optimizer!r}: expected sgd or adamw")
    return make


def strategy_options(cfg: Config):
    """Build the typed options object of the configured strategy from its config table."""
    s = cfg.train.strategy
    if s == "ddp":
        from hpctrain.parallel.ddp import DDPOptions

        d = cfg.ddp
        return DDPOptions(fp16_compression=d.fp16_compression,
                          fusion_threshold_mb=d.fusion_threshold_mb,
                          cycle_time_ms=d.cycle_time_ms, grad_accum=cfg.train.grad_accum,
                          sync_batchnorm=d.sync_batchnorm)
    if s in ("zero1", "zero2", "zero3"):
        from hpctrain.parallel.zero import ZeroOptions

        z = cfg.zero
        return ZeroOptions(stage=int(s[-1]), grad_accum=cfg.train.grad_accum,
                           sync_batchnorm=z.sync_batchnorm, auto_wrap_policy=z.auto_wrap_policy,
                           wrap_classes=_class_names(z.wrap_classes), min_params=z.min_params)
    if s == "pipeline":
        from hpctrain.parallel.pipeline import PipelineOptions

        pl = cfg.pipeline
        return PipelineOptions(mesh=cfg.runtime.mesh, schedule=pl.schedule,
                               microbatches=pl.microbatches, virtual_stages=pl.virtual_stages,
                               balance=pl.balance, split_points=pl.split_points,
                               activation_checkpointing=cfg.train.activation_checkpointing,
                               dp_sharding=pl.dp_sharding, p2p=pl.p2p)
    if s == "domain":
        from hpctrain.parallel.domain.strategy import DomainOptions

        return DomainOptions(mesh=cfg.runtime.mesh, overlap=cfg.domain.overlap)
    if s == "fsdp":
        return fsdp_options(cfg)
    return None


def fsdp_options(cfg: Config):
    """FSDPOptions from the [fsdp] table (and train.grad_accum)."""
    from hpctrain.parallel.fsdp import FSDPOptions

    f = cfg.fsdp
    return FSDPOptions(sharding_strategy=f.sharding_strategy, auto_wrap_policy=f.auto_wrap_policy,
                       wrap_classes=_class_names(f.wrap_classes),
                       min_params=f.min_params, backward_prefetch=f.backward_prefetch,
                       param_dtype=f.param_dtype, reduce_dtype=f.reduce_dtype,
                       buffer_dtype=f.buffer_dtype, cpu_offload=f.cpu_offload,
                       grad_accum=cfg.train.grad_accum, sync_batchnorm=f.sync_batchnorm)


def _class_names(text: str) -> tuple:
    """'GPTBlock, MLPBlock' -> ('GPTBlock', 'MLPBlock')."""
    return tuple(c.strip() for c in text.split(",") if c.strip())
