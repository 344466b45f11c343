"""Domain strategy config checks run before MPI (no ranks needed)."""

import pytest

from hpctrain.config import ConfigError, load_config


def _cfg(**train):
    return load_config(None, [{"train": {"strategy": "domain", "model": "unet", **train}}])


def test_domain_batch_is_split_over_dp_only():
    cfg = _cfg(global_batch_size=2)
    cfg.runtime.mesh = "dom=2x2"
    cfg.validate(4)  # 2 samples, 1 dp group: fine although 4 ranks
    cfg.runtime.mesh = "dp=2,dom=2"
    cfg.validate(4)
    cfg.train.global_batch_size = 1
    with pytest.raises(ConfigError, match="fewer than the 2 ranks"):
        cfg.validate(4)


def test_domain_rejects_pp_and_tp_and_bad_degrees():
    cfg = _cfg(global_batch_size=4)
    cfg.runtime.mesh = "pp=2,dom=2"
    with pytest.raises(ConfigError, match="dom and dp only"):
        cfg.validate(4)
    cfg.runtime.mesh = "dom=3"
    with pytest.raises(ConfigError, match="multiply to 3"):
        cfg.validate(4)


def test_unet_size_must_halve_cleanly():
    from hpctrain.models.unet import factory

    with pytest.raises(ValueError, match="divisible by 2\\*\\*depth=4"):
        factory(0, size=34, depth=2)


def test_dom_grid_with_too_many_dims_fails_before_collectives():
    from hpctrain.parallel.domain.decomposition import grid_shape_for

    with pytest.raises(ValueError, match="2 spatial dimensions"):
        grid_shape_for((2, 2, 2), 2)
