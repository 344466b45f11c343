"""Config -> the typed options the orchestrator takes, per table: each table IS its options
class (registry.OPTIONS), filled in with what the run gives."""

from __future__ import annotations

import copy
import dataclasses

from hpctrain import registry
from hpctrain.config import Config, _field_type, config_keys
from hpctrain.option import names

__all__ = ["plan_options", "strategy_options"]


def plan_options(cfg: Config, flavour: str | None = None) -> dict:
    """The options of every table a plan may read, keyed by table name (the orchestrator
    picks the ones its transforms use): each table IS its options class (registry.OPTIONS),
    so this is a copy of the validated section with what the run gives filled in: the
    fields [train] sets (grad_accum, activation checkpointing) and the zero stage of
    ``flavour`` (default: the strategy's, or runtime.dp_flavour)."""
    t = cfg.train
    flavour = flavour or cfg.runtime.dp_flavour or t.strategy
    stage = registry.flavour(flavour).stage if flavour in registry.FLAVOUR_NAMES else None
    given = {"grad_accum": t.grad_accum, "activation_checkpointing": t.activation_checkpointing,
             "stage": stage}
    return {table: _for_run(getattr(cfg, table), given) for table in registry.OPTIONS}


def _for_run(section, given: dict):
    """A copy of ``section`` with the run's values of its ``given`` fields (a tuple key
    assigned its TOML string form in Python read as the config reads it)."""
    keys = {f.name for f in dataclasses.fields(section)} - {f.name for f in config_keys(section)}
    values = {k: v for k, v in given.items() if k in keys}
    values.update({f.name: names(getattr(section, f.name)) for f in config_keys(section)
                   if _field_type(f) is tuple})
    return dataclasses.replace(copy.deepcopy(section), **values)


def strategy_options(cfg: Config):
    """The typed options of the strategy's own table (None for single)."""
    table = registry.STRATEGY_TABLE.get(cfg.train.strategy)
    return plan_options(cfg)[table] if table else None
