"""A run checked before any collective: the config validated and its plan built once,
then every check of the model against that plan that needs no communication.

The CLI runs it before MPI starts (every rank alike, so a refusal is one line and exit 2)
and hands the result to the TrainingRun, which runs it itself only when nobody did
(the Python API).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpctrain.config import Config
from hpctrain.data.sampler import collate
from hpctrain.data.structure import to_device
from hpctrain.models.registry import BuiltModel
from hpctrain.parallel.plan import ParallelPlan
from hpctrain.train.dropout import check_dropout
from hpctrain.train.loss_count import check_loss_count
from hpctrain.train.plan_options import plan_options
from hpctrain.train.weighting import LossWeighting

__all__ = ["CheckedRun", "check_run"]


@dataclass(frozen=True)
class CheckedRun:
    """The validated plan of a config at one world size, the loss weighting (its count
    measured where the loss declares none), and the notes rank 0 prints."""

    plan: ParallelPlan
    weighting: LossWeighting
    notes: tuple


def check_run(cfg: Config, plan: ParallelPlan, built: BuiltModel) -> CheckedRun:
    """Check the model against cfg's validated plan (``cfg.check(world_size)``): dropout
    the plan cannot give one process's masks, a loss whose count the tokens weighting cannot
    tell, the tensor-parallel split and its loss, the domain split of every op of the
    forward (on two whole samples; the domain transform itself then needs no sample). Raises ConfigError / UsageError / ValueError; no communication."""
    weighting = LossWeighting(cfg.train.loss_weight, cfg.train.ignore_index)
    notes = (check_dropout(plan, built.model, built.dataset, cfg.train.per_rank_dropout),
             check_loss_count(weighting, built.model, built.dataset, built.loss_fn))
    if plan.tensor:
        from hpctrain.parallel.tensor import check as check_tensor

        check_tensor(built.model, plan_options(cfg, plan.flavour)["tensor"], plan.tp,
                     built.loss_fn, plan.flavour, plan.dp)
    if plan.domain and isinstance(built.model, torch.nn.Module):
        from hpctrain.parallel.domain.functional import check as check_domain

        x = collate(built.dataset, range(min(2, len(built.dataset))))[0]
        device = next((p.device for p in built.model.parameters()), torch.device("cpu"))
        check_domain(built.model, to_device(x, device))
    return CheckedRun(plan, weighting, tuple(n for n in notes if n))
