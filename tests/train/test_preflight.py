"""Checks before MPI: directories, environment, device, data set size (no MPI)."""

import os

import pytest

from hpctrain.config import ConfigError, load_config
from hpctrain.errors import UsageError
from hpctrain.runtime.launcher import LaunchInfo
from hpctrain.train.preflight import check_dataset, check_writable_dir, preflight

ONE = LaunchInfo("single", 0, 1, 0, 1, 0, 1, None)


def test_writable_dirs(tmp_path):
    check_writable_dir(str(tmp_path), "x")
    check_writable_dir(str(tmp_path / "new" / "deeper"), "x")  # can be created
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_writable_dir(str(f), "checkpoint.dir")
    with pytest.raises(ConfigError, match="cannot be created: .* is a file"):
        check_writable_dir(str(f / "sub"), "checkpoint.dir")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_read_only_directory_is_refused_even_for_root():
    with pytest.raises(ConfigError, match="not writable"):
        check_writable_dir("/proc/self", "train.out_dir")


def _cfg(**train):
    return load_config(None, [{"train": {"progress": "off", **train}}])


def test_preflight_names_the_key(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    cases = [
        ({"checkpoint": {"dir": str(f)}}, "checkpoint.dir (--checkpoint-dir)"),
        ({"train": {"out_dir": str(f)}}, "train.out_dir (--out-dir)"),
        ({"train": {"summary": str(tmp_path)}}, "is a directory"),
        ({"checkpoint": {"resume": str(tmp_path / "none.h5")}}, "does not exist"),
        ({"runtime": {"device": "cuda"}}, "runtime.device = 'cuda' (--device)"),
    ]
    for override, words in cases:
        cfg = load_config(None, [override])
        with pytest.raises((ConfigError, UsageError)) as err:
            preflight(cfg, {}, ONE)
        assert words in str(err.value), err.value


def test_preflight_reads_the_environment_strictly(tmp_path):
    cfg = _cfg(out_dir=str(tmp_path))
    preflight(cfg, {}, ONE)
    for env, words in [({"HPCTRAIN_CKPT_FORCE_SERIAL": "maybe"}, "not a clear boolean"),
                       ({"HPCTRAIN_DEVICE": "gpu"}, "HPCTRAIN_DEVICE='gpu'"),
                       ({"OMP_NUM_THREADS": "x"}, "OMP_NUM_THREADS"),
                       ({"HPCTRAIN_RANKS_PER_NODE": "3"}, "not divisible"),
                       ({"HPCTRAIN_DATA_DIR": str(tmp_path / "f")}, "not a directory")]:
        (tmp_path / "f").write_text("")
        with pytest.raises(ValueError, match=words):
            preflight(cfg, env, LaunchInfo("openmpi", 0, 2, 0, 2, None, None, None))


def test_data_set_smaller_than_a_batch():
    check_dataset(_cfg(global_batch_size=32), 32)
    with pytest.raises(ConfigError, match="has only 31 samples"):
        check_dataset(_cfg(global_batch_size=32), 31)
