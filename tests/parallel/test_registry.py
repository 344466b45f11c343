"""The one registry (hpctrain/registry.py): everything that names a parallelism or a mesh
key derives from it, and each options class is its config table."""

import dataclasses
import importlib

import pytest

from hpctrain import config
from hpctrain.config import Config
from hpctrain import registry
from hpctrain.parallel.plan import build_plan
from hpctrain.runtime.mesh import DIMS, MeshLayout
from hpctrain.train.plan_options import plan_options


@pytest.mark.parametrize("table", list(registry.OPTIONS))
def test_each_options_class_is_its_config_table(table):
    """Each options class is a dataclass whose every field carries its help line (a config
    key's, or a field the run fills in), and it IS the config's [table]."""
    cls = registry.options_class(table)
    assert dataclasses.is_dataclass(cls)
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
    assert type(getattr(Config(), table)) is cls


def test_the_mesh_keys_are_the_registrys():
    """The mesh's keys and rank order, its grid keys and the plan's attributes come from the
    registry's dimensions (pp, dp, dom, tp: tp fastest of these four)."""
    assert DIMS == registry.MESH_KEYS
    assert [k for k in DIMS if k in ("pp", "dp", "dom", "tp")] == ["pp", "dp", "dom", "tp"]
    assert "dom" in registry.GRID_KEYS and "tp" not in registry.GRID_KEYS
    assert [f.name for f in dataclasses.fields(MeshLayout)] == list(DIMS)
    plan = build_plan("pipeline", "pp=2,tp=2", 4)
    assert (plan.pp, plan.tp, plan.dp, plan.dom, plan.dom_size) == (2, 2, 1, (1,), 1)
    assert plan.pipeline and plan.tensor and not plan.domain and plan.world_size == 4
    with pytest.raises(AttributeError, match="mesh keys pp, dp, dom, tp"):
        plan.xx


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
