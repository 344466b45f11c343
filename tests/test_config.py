"""Config: defaults, TOML + overrides, validation errors (no MPI)."""

import pytest

from hpctrain.config import Config, ConfigError, load_config, parse_assignment


def test_defaults_validate():
    cfg = Config().validate(1)
    assert cfg.train.strategy == "single" and cfg.train.model == "gpt"


def test_toml_then_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nmodel = "mlp"\nsteps = 7\nlr = 1\n[ddp]\nfp16_compression = true\n'
                 '[train.model_options]\nhidden = 5\n')
    cfg = load_config(str(f), [{"train": {"steps": 9}}])
    assert (cfg.train.model, cfg.train.steps, cfg.train.lr) == ("mlp", 9, 1.0)
    assert cfg.ddp.fp16_compression is True
    assert cfg.train.model_options == {"hidden": 5}


def test_round_trip_toml(tmp_path):
    cfg = load_config(None, [{"train": {"model": 'we"ird', "model_options": {"a": 1}}},
                             {"runtime": {"mesh": "dp=2"}}])
    f = tmp_path / "c.toml"
    f.write_text(cfg.to_toml())
    assert load_config(str(f)).to_dict() == cfg.to_dict()


@pytest.mark.parametrize("override, words", [
    ({"train": {"steps": 0}}, ["train.steps", ">= 1"]),
    ({"train": {"lr_schedule": "warmup_cosine", "warmup_steps": 500}},
     ["train.warmup_steps = 500", "at most 200"]),
    ({"train": {"strategy": "nope"}}, ["train.strategy", "single"]),
    ({"train": {"lr": "fast"}}, ["train.lr", "a number"]),
    ({"train": {"steps": 2.5}}, ["train.steps", "an integer"]),
    ({"train": {"steps": True}}, ["train.steps", "an integer"]),
    ({"train": {"activation_checkpointing": 1}}, ["activation_checkpointing", "true or false"]),
    ({"train": {"stepz": 3}}, ["unknown key train.stepz", "steps"]),
    ({"trian": {"steps": 3}}, ["unknown table [trian]"]),
    ({"train": {"lr": float("nan")}}, ["train.lr", "finite"]),
    ({"train": {"grad_accum": 64}}, ["grad_accum", "global_batch_size"]),
    ({"zero": {"reduce_bucket_size": 0}}, ["zero.reduce_bucket_size = 0", ">= 1"]),
    ({"fsdp": {"reduce_bucket_size": -4096}}, ["fsdp.reduce_bucket_size = -4096", ">= 1"]),
    ({"fsdp": {"allgather_bucket_size": 2.5}}, ["fsdp.allgather_bucket_size", "an integer"]),
    ({"zero": {"reduce_bucket_size": "16MB"}}, ["zero.reduce_bucket_size", "an integer"]),
])
def test_bad_values_name_the_key(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override]).validate(1)
    for w in words:
        assert w in str(err.value)


def test_world_size_rules():
    with pytest.raises(ConfigError, match="launcher started 4 ranks"):
        Config().validate(4)
    cfg = load_config(None, [{"train": {"strategy": "ddp", "global_batch_size": 6, "grad_accum": 2}}])
    cfg.validate(3)
    with pytest.raises(ConfigError, match="fewer than the 4 ranks"):
        cfg.validate(4)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_parse_assignment():
    assert parse_assignment("ddp.fp16_compression=true") == {"ddp": {"fp16_compression": True}}
    assert parse_assignment("train.optimizer=adamw") == {"train": {"optimizer": "adamw"}}
    assert parse_assignment("train.lr=1e-3") == {"train": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_assignment("lr=3")


def test_effective_mesh_defaults_follow_the_strategy():
    from hpctrain.config import load_config

    def mesh(strategy, mesh=""):
        return load_config(overrides=[{"train": {"strategy": strategy},
                                       "runtime": {"mesh": mesh}}]).effective_mesh(4)

    assert mesh("ddp") == "dp=4"
    assert mesh("pipeline") == "pp=4"
    assert mesh("domain") == "dom=4"
    assert mesh("pipeline", "dp=2,pp=2") == "pp=2,dp=2"
    assert mesh("zero3", "dom=2,dp=2") == "dp=2,dom=2"


def test_dotted_set_and_later_tables_merge_into_the_toml_table(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nmodel = "mlp"\n[train.model_options]\nhidden = 5\nlayers = 3\n')
    assert parse_assignment("train.model_options.layers=2") == \
        {"train": {"model_options": {"layers": 2}}}
    cfg = load_config(str(f), [parse_assignment("train.model_options.layers=2")])
    assert cfg.train.model_options == {"hidden": 5, "layers": 2}
    cfg = load_config(str(f), [parse_assignment("train.model_options={layers=1, depth=4}")])
    assert cfg.train.model_options == {"hidden": 5, "layers": 1, "depth": 4}
    with pytest.raises(ConfigError, match="empty name"):
        parse_assignment("train..layers=2")
    with pytest.raises(ConfigError, match="ddp.fp16_compression"):
        load_config(None, [parse_assignment("ddp.fp16_compression.x=1")])


@pytest.mark.parametrize("strategy, table, key, value", [
    ("ddp", "fsdp", "sharding_strategy", "NO_SHARD"),
    ("zero1", "ddp", "fp16_compression", True),
    ("fsdp", "zero", "sync_batchnorm", False),
    ("single", "pipeline", "microbatches", 8),
    ("pipeline", "domain", "overlap", True),
])
def test_options_of_another_strategy_are_refused(strategy, table, key, value):
    cfg = load_config(None, [{"train": {"strategy": strategy, "global_batch_size": 8},
                              table: {key: value}}])
    with pytest.raises(ConfigError) as err:
        cfg.validate(1)
    msg = str(err.value)
    assert f"{table}.{key} = {value!r} is set" in msg and f"'{strategy}'" in msg


def test_printed_config_of_one_strategy_loads_under_it(tmp_path):
    # Every table is written out, all at their defaults but the strategy's own: no refusal.
    cfg = load_config(None, [{"train": {"strategy": "fsdp", "global_batch_size": 8},
                              "fsdp": {"sharding_strategy": "NO_SHARD"}}]).validate(2)
    f = tmp_path / "c.toml"
    f.write_text(cfg.to_toml())
    load_config(str(f)).validate(2)
    with pytest.raises(ConfigError, match="does not read \\[fsdp\\]"):
        load_config(str(f), [{"train": {"strategy": "ddp"}}]).validate(2)


def test_empty_choice_is_shown_readably():
    with pytest.raises(ConfigError) as err:
        load_config(None, [{"train": {"strategy": "fsdp"}, "fsdp": {"param_dtype": "fp8"}}]
                    ).validate(1)
    assert "expected one of '' (keep), fp32, bf16, fp16" in str(err.value)


def test_ranks_per_node_must_divide_the_world():
    cfg = load_config(None, [{"train": {"strategy": "ddp", "global_batch_size": 8},
                              "runtime": {"ranks_per_node": 3}}])
    with pytest.raises(ConfigError, match="not divisible by it"):
        cfg.validate(2)
    cfg.validate(3)


def test_builtin_model_names_match_the_registry():
    from hpctrain.config import BUILTIN_MODELS
    from hpctrain.models.registry import BUILTIN

    assert sorted(BUILTIN_MODELS) == sorted(BUILTIN)


@pytest.mark.parametrize("strategy, table", [("zero3", "zero"), ("fsdp", "fsdp")])
def test_unit_policies_need_their_arguments_before_mpi(strategy, table):
    for policy, words in (("class", f"{table}.wrap_classes"), ("size", f"{table}.min_params")):
        cfg = load_config(None, [{"train": {"strategy": strategy, "global_batch_size": 8},
                                  table: {"auto_wrap_policy": policy}}])
        with pytest.raises(ConfigError, match=words):
            cfg.validate(2)
