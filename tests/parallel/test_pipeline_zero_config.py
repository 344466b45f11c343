"""pipeline.dp_sharding: a bad value is one clear ConfigError (pure: before any MPI work),
and the value reaches the pipeline's options."""

import pytest

from hpctrain.config import Config, ConfigError
from hpctrain.parallel.pipeline import PipelineOptions
from hpctrain.train.plan_options import strategy_options


def _cfg(value):
    cfg = Config()
    cfg.train.strategy = "pipeline"
    cfg.runtime.mesh = "dp=2,pp=2"
    cfg.pipeline.dp_sharding = value
    return cfg


@pytest.mark.parametrize("bad", ["zero4", "hybrid", "", "ZERO1"])
def test_bad_dp_sharding_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"pipeline\.dp_sharding = .*expected one of ddp, "
                                          r"zero1, zero2, zero3, fsdp"):
        _cfg(bad).validate(4)


@pytest.mark.parametrize("good", ["ddp", "zero1", "zero2", "zero3", "fsdp"])
def test_dp_sharding_reaches_the_pipeline_options(good):
    cfg = _cfg(good).validate(4)
    opts = strategy_options(cfg)
    assert isinstance(opts, PipelineOptions) and opts.dp_sharding == good


def test_default_is_ddp():
    assert Config().pipeline.dp_sharding == "ddp" and PipelineOptions().dp_sharding == "ddp"


def test_dp_sharding_is_the_plans_flavour():
    cfg = _cfg("zero3").validate(4)
    plan = cfg.plan(4)
    assert plan.flavour == "zero3" and plan.name == "pipeline" and plan.pipeline
    cfg = _cfg("zero2")
    cfg.runtime.dp_flavour = "zero3"
    with pytest.raises(ConfigError, match="disagree"):
        cfg.validate(4)


# pipeline.p2p: the issue order of stage messages (eager on CPU, ordered for NCCL).

@pytest.mark.parametrize("bad", ["nccl", "", "Ordered"])
def test_bad_p2p_is_a_config_error(bad):
    cfg = _cfg("ddp")
    cfg.pipeline.p2p = bad
    with pytest.raises(ConfigError, match=r"pipeline\.p2p = .*expected one of auto, eager, "
                                          r"ordered"):
        cfg.validate(4)


def test_p2p_reaches_the_pipeline_and_auto_follows_the_device():
    import torch

    from hpctrain.parallel.pipeline.options import P2P as PIPELINE_P2P
    from hpctrain.parallel.pipeline import prepare
    from hpctrain.parallel.pipeline.p2p import P2P_MODES, ordered_mode

    assert PIPELINE_P2P == P2P_MODES and Config().pipeline.p2p == "auto"
    cfg = _cfg("ddp")
    cfg.pipeline.p2p = "ordered"
    assert strategy_options(cfg.validate(4)).p2p == "ordered"
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert [ordered_mode("auto", d, 2) for d in (cpu, gpu)] == [False, True]
    assert ordered_mode("ordered", cpu, 2) and not ordered_mode("eager", gpu, 2)
    assert not ordered_mode("ordered", gpu, 1)  # one rank: every message is local
    with pytest.raises(ValueError, match="pipeline.p2p = 'nccl'"):
        prepare(None, None, PipelineOptions(p2p="nccl"))  # before the world is touched
