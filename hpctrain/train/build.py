"""What a config names, built: the model, its data set and loss (only each rank's part where
the plan keeps no whole model), and the run's output directory."""

from __future__ import annotations

import os
import time

from hpctrain.config import Config
from hpctrain.models.registry import BuiltModel, build, build_deferred, build_layers
from hpctrain.parallel.orchestrator import defer_init

__all__ = ["build_model", "run_dir", "keeps_a_part"]


def build_model(cfg: Config, world_size: int | None = None, plan=None) -> BuiltModel:
    """Build model, data set and loss from the config (no communication; raises ValueError).

    A plan with a pipeline gets a LayerStack instead of a model (each rank builds only its
    stage); with the plan (or the world size) given, a split that cannot fit is reported
    here, before MPI.
    """
    t = cfg.train
    if plan is None and world_size is not None:
        plan = cfg.plan(world_size)
    if plan.pipeline if plan is not None else t.strategy == "pipeline":
        built = build_layers(t.model, t.seed, **t.model_options)
        if plan is not None:
            from hpctrain.parallel.pipeline import check_fits

            pl = cfg.pipeline
            v = pl.virtual_stages if pl.schedule == "interleaved-1f1b" else 1
            check_fits(len(built.model), plan.pp, v, pl.schedule)
        return built
    if plan is not None and t.deferred_init and keeps_a_part(plan, cfg):
        deferred = build_deferred(t.model, t.seed, **t.model_options)
        if deferred is not None:
            built, stack = deferred
            if stack is not None:
                defer_init(built.model, stack)
            return built
    return build(t.model, t.seed, **t.model_options)


def run_dir(cfg: Config, plan_name: str, mpi_comm) -> str:
    """Where this run's metrics, summary, report and TensorBoard events go: train.out_dir,
    or out_dir/run_name when a name is given ('auto': rank 0's timestamp and the plan name,
    the same on every rank). Collective only for 'auto'."""
    t = cfg.train
    if not t.out_dir or not t.run_name:
        return t.out_dir
    name = t.run_name
    if name == "auto":
        name = mpi_comm.bcast(time.strftime("%Y%m%d-%H%M%S-") + plan_name, root=0)
    return os.path.join(t.out_dir, name)


def keeps_a_part(plan, cfg: Config) -> bool:
    """Plans where no rank keeps the whole model: the build fills only each rank's part
    (parallel/deferred.py). A pipeline builds only its stages' layers anyway; a domain
    split keeps whole weights."""
    if plan.pipeline or plan.domain:
        return False
    return plan.tensor or plan.flavour == "zero3" or (
        plan.flavour == "fsdp" and cfg.fsdp.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"))
