"""Config -> what the orchestrator takes: typed options per table and the optimizer factory."""

from __future__ import annotations

import torch

from hpctrain.config import Config, TrainSection

__all__ = ["make_optimizer_factory", "plan_options", "strategy_options"]


def make_optimizer_factory(t: TrainSection):
    """Return params -> optimizer for the configured optimizer (strategies call it)."""
    def make(params):
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        if t.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
        raise ValueError(f"optimizer {t.optimizer!r}: expected sgd or adamw")
    return make


def plan_options(cfg: Config, flavour: str | None = None) -> dict:
    """Typed options of every table a plan may read, keyed by table name (the orchestrator
    picks the ones its transforms use); ``flavour`` sets the zero stage (default: the
    strategy's, or runtime.dp_flavour)."""
    from hpctrain.parallel.ddp import DDPOptions
    from hpctrain.parallel.domain.strategy import DomainOptions
    from hpctrain.parallel.pipeline import PipelineOptions
    from hpctrain.parallel.tensor import TensorOptions
    from hpctrain.parallel.zero import ZeroOptions

    t, d, z, pl = cfg.train, cfg.ddp, cfg.zero, cfg.pipeline
    flavour = flavour or cfg.runtime.dp_flavour or t.strategy
    stage = int(flavour[-1]) if flavour in ("zero1", "zero2", "zero3") else None
    return {
        "ddp": DDPOptions(fp16_compression=d.fp16_compression,
                          fusion_threshold_mb=d.fusion_threshold_mb,
                          cycle_time_ms=d.cycle_time_ms, grad_accum=t.grad_accum,
                          sync_batchnorm=d.sync_batchnorm),
        "zero": ZeroOptions(stage=stage, grad_accum=t.grad_accum,
                            sync_batchnorm=z.sync_batchnorm, auto_wrap_policy=z.auto_wrap_policy,
                            wrap_classes=_class_names(z.wrap_classes), min_params=z.min_params),
        "fsdp": fsdp_options(cfg),
        "pipeline": PipelineOptions(schedule=pl.schedule, microbatches=pl.microbatches,
                                    virtual_stages=pl.virtual_stages, balance=pl.balance,
                                    split_points=pl.split_points,
                                    activation_checkpointing=t.activation_checkpointing,
                                    dp_sharding=pl.dp_sharding, p2p=pl.p2p),
        "domain": DomainOptions(overlap=cfg.domain.overlap),
        "tensor": TensorOptions(sequence_parallel=cfg.tensor.sequence_parallel,
                                plan=dict(cfg.tensor.plan)),
    }


def strategy_options(cfg: Config):
    """The typed options of the strategy's own table (None for single)."""
    from hpctrain.parallel.plan import STRATEGY_TABLE

    table = STRATEGY_TABLE.get(cfg.train.strategy)
    return plan_options(cfg)[table] if table else None


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
