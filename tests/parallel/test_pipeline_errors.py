"""Bad pipeline setups fail with one clear error before any communication."""

import pytest
from torch import nn

from hpctrain.config import Config, ConfigError
from hpctrain.models.gpt import GPT
from hpctrain.parallel.pipeline.transform import _as_stack
from hpctrain.train.build import build_model
from tests.mpirun import run_mpi


def _cfg(mesh="pp=2", gbs=16, m=4, sched="1f1b", v=2, model="mlp", layers=4, accum=1):
    cfg = Config()
    cfg.train.strategy, cfg.train.model = "pipeline", model
    cfg.train.model_options = {"layers": layers}
    cfg.train.global_batch_size, cfg.train.grad_accum = gbs, accum
    cfg.runtime.mesh = mesh
    cfg.pipeline.schedule, cfg.pipeline.microbatches, cfg.pipeline.virtual_stages = sched, m, v
    return cfg


def test_valid_setups_pass():
    _cfg().validate(2)
    _cfg(mesh="dp=2,pp=2").validate(4)
    _cfg(mesh="", sched="interleaved-1f1b").validate(4)  # '' = pp over every rank
    build_model(_cfg(mesh="pp=4", sched="interleaved-1f1b", layers=6), 4)  # 8 layers, 8 stages


def test_microbatches_not_dividing_the_batch():
    with pytest.raises(ConfigError, match=r"pipeline.microbatches = 3 does not divide the batch"):
        _cfg(m=3).validate(2)
    # dp replicas and gradient accumulation each take their share first.
    with pytest.raises(ConfigError, match=r"grad_accum \(2\) x dp \(2\) x microbatches \(4\) = 16"):
        _cfg(mesh="dp=2,pp=2", gbs=24, accum=2).validate(4)


def test_interleaved_rules():
    with pytest.raises(ConfigError, match="must be a multiple of pp = 4"):
        _cfg(mesh="pp=4", m=6, gbs=24, sched="interleaved-1f1b").validate(4)
    with pytest.raises(ConfigError, match="virtual_stages = 1 with interleaved-1f1b"):
        _cfg(sched="interleaved-1f1b", v=1).validate(2)


def test_interleaved_with_too_few_layers():
    # mlp with 4 hidden blocks = 6 pipeline layers; 4 ranks x 2 chunks = 8 stages.
    with pytest.raises(ValueError, match="needs 8 stages .* only 6 layers"):
        build_model(_cfg(mesh="pp=4", sched="interleaved-1f1b"), 4)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="pp=8 stages but the model has only 6 layers"):
        build_model(_cfg(mesh="pp=8", m=8, gbs=16), 8)


def test_mesh_not_fitting_the_world():
    with pytest.raises(ConfigError, match="multiply to 4, not 2"):
        _cfg(mesh="dp=2,pp=2").validate(2)
    with pytest.raises(ConfigError, match="strategy 'pipeline' uses pp, dp and tp"):
        _cfg(mesh="pp=2,dom=2").validate(4)


def test_fp16_rejected():
    cfg = _cfg()
    cfg.train.precision = "fp16"
    with pytest.raises(ConfigError, match="use bf16"):
        cfg.validate(2)


@pytest.mark.mpi
def test_cli_reports_one_error_for_too_many_stages():
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--strategy", "pipeline", "--model", "mlp",
                       "--set", "train.model_options={layers=1}", "--mesh", "pp=2",
                       "--set", "pipeline.schedule=interleaved-1f1b", "--set",
                       "pipeline.virtual_stages=3", "--global-batch-size", "8",
                       "--steps", "1", "--progress", "off", "--out-dir", ""],
                   check=False, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("hpctrain: error:") == 1, proc.stderr
    assert "needs 6 stages" in proc.stderr and "only 3 layers" in proc.stderr, proc.stderr


def test_wrap_takes_a_sequential_and_names_what_it_expects_otherwise():
    stack = _as_stack(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)))
    assert [layer.name for layer in stack.layers] == ["0", "1", "2"]
    # Not a known architecture: the generic chain is a guess until checked on a sample.
    with pytest.raises(TypeError, match="splitting GPT as a generic chain .* needs a sample"):
        _as_stack(GPT())
    with pytest.raises(TypeError, match="takes an nn.Module whose forward is a chain of "
                                        "layers or a .*LayerStack, got dict"):
        _as_stack({})
