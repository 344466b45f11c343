"""pipeline.dp_sharding: a bad value is one clear ConfigError (pure: before any MPI work),
and the value reaches the pipeline's options."""

import pytest

from hpctrain.config import Config, ConfigError
from hpctrain.parallel.pipeline import PipelineOptions
from hpctrain.train.strategy import strategy_options


def _cfg(value):
    cfg = Config()
    cfg.train.strategy = "pipeline"
    cfg.runtime.mesh = "dp=2,pp=2"
    cfg.pipeline.dp_sharding = value
    return cfg


@pytest.mark.parametrize("bad", ["zero3", "fsdp", "", "ZERO1"])
def test_bad_dp_sharding_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"pipeline\.dp_sharding = .*expected one of ddp, "
                                          r"zero1, zero2"):
        _cfg(bad).validate(4)


@pytest.mark.parametrize("good", ["ddp", "zero1", "zero2"])
def test_dp_sharding_reaches_the_pipeline_options(good):
    cfg = _cfg(good).validate(4)
    opts = strategy_options(cfg)
    assert isinstance(opts, PipelineOptions) and opts.dp_sharding == good


def test_default_is_ddp():
    assert Config().pipeline.dp_sharding == "ddp" and PipelineOptions().dp_sharding == "ddp"


def test_wrap_refuses_a_bad_value_before_any_collective():
    from hpctrain.parallel.pipeline import wrap

    # world=None: wrap must raise before it touches the world (no collective, no mesh).
    with pytest.raises(ValueError, match="pipeline.dp_sharding = 'zero3'"):
        wrap(None, None, None, PipelineOptions(dp_sharding="zero3"))


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

    from hpctrain.config import PIPELINE_P2P
    from hpctrain.parallel.pipeline import wrap
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
        wrap(None, None, None, PipelineOptions(p2p="nccl"))
