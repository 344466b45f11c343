"""The one registry (hpctrain/registry.py): everything that names a parallelism derives from
it, and each config section fills its options class field by field."""

import dataclasses
import importlib

import pytest

from hpctrain import config
from hpctrain.config import Config
from hpctrain import registry
from hpctrain.parallel.plan import build_plan
from hpctrain.train.strategy import _options, plan_options


def _class(spec):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("table", registry.TABLES)
def test_each_section_is_its_options_class(table):
    """Every key of the [table] section is a field of its options class, with the same
    default (a class list is a comma-separated string in TOML, a tuple in the options)."""
    section, cls = getattr(Config(), table), _class(registry.OPTIONS[table])
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(section):
        assert f.name in fields, f"[{table}] {f.name} has no field in {cls.__name__}"
        built = getattr(_options(section, registry.OPTIONS[table], {}), f.name)
        want = getattr(cls(), f.name)
        assert built == want, (table, f.name, built, want)


def test_everything_that_names_a_strategy_derives_from_the_registry():
    import hpctrain.parallel as parallel

    assert config.STRATEGIES == parallel.STRATEGIES == registry.STRATEGIES
    assert set(registry.TABLES) == set(registry.OPTIONS)
    assert dict(dataclasses.fields(config.TrainSection)[1].metadata)["choices"] == \
        registry.STRATEGIES
    assert registry.SHARDED_FLAVOURS == ("zero1", "zero2", "zero3", "fsdp")
    for f in registry.FLAVOURS:
        assert callable(importlib.import_module(f.module).wrap), f.name
    for d in registry.DIMENSIONS:  # each dimension: a mesh key, a table, composes both ways
        assert d.table in registry.OPTIONS
        for other in d.composes_with:
            assert d.key in registry.dimension(other).composes_with, (d.key, other)


def test_options_take_the_train_keys_and_the_flavours_stage():
    cfg = Config()
    cfg.train.strategy, cfg.train.grad_accum = "zero2", 3
    cfg.train.activation_checkpointing = True
    cfg.zero.wrap_classes = "GPTBlock, MLPBlock"
    opts = plan_options(cfg)
    assert (opts["zero"].stage, opts["zero"].grad_accum) == (2, 3)
    assert opts["zero"].wrap_classes == ("GPTBlock", "MLPBlock")
    assert opts["pipeline"].activation_checkpointing and opts["ddp"].grad_accum == 3
    cfg.tensor.plan = {"a": "colwise"}
    assert plan_options(cfg)["tensor"].plan is not cfg.tensor.plan  # a copy


@pytest.mark.parametrize("strategy, mesh, tables", [
    ("single", "", ()), ("ddp", "", ("ddp",)), ("zero1", "", ("zero",)),
    ("fsdp", "", ("fsdp",)), ("pipeline", "", ("pipeline",)), ("tensor", "", ("tensor",)),
    ("domain", "", ("domain", "ddp")), ("zero3", "dom=2,dp=2", ("domain", "zero")),
    ("pipeline", "pp=2,tp=2", ("pipeline", "tensor")),
])
def test_tables_read_follow_the_plans_dimensions(strategy, mesh, tables):
    plan = build_plan(strategy, mesh, 1 if strategy == "single" else 4)
    assert registry.tables_read(plan) == tables
    assert plan.transforms()[:-1] == [d.strategy for d in registry.by_transform_order()
                                      if plan.uses(d.strategy)] or strategy == "single"
