"""Checks that need no communication, run on every rank before MPI starts.

Whatever can be known from the config, the environment and the file system is checked
here, so a bad directory, device or variable stops the job in the first second with one
line, instead of at the first checkpoint after hours of training.
"""

from __future__ import annotations

import os
import tempfile
from typing import Mapping

from hpctrain.config import Config, ConfigError
from hpctrain.errors import UsageError
from hpctrain.runtime.device import cpu_threads, cuda_count, select_device
from hpctrain.runtime.env import env_flag
from hpctrain.runtime.launcher import LaunchInfo
from hpctrain.runtime.malloc import mmap_threshold_kb
from hpctrain.runtime.world import comm_choice, ranks_per_node_override
from hpctrain.train.schedule import check_schedule
from hpctrain.train.optimizers import check_optimizer

__all__ = ["check_writable_dir", "check_environment", "check_dataset", "preflight"]


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_writable_dir(path: str, what: str) -> None:
    """Raise ConfigError unless path is a directory we can write, or can be created as one."""
    full = os.path.abspath(path)
    if os.path.exists(full):
        if not os.path.isdir(full):
            raise ConfigError(f"{what} = {path!r} is a file, not a directory; pass a directory")
        try:  # os.access says yes to root on read-only mounts; a real file says the truth
            with tempfile.TemporaryFile(dir=full):
                pass
        except OSError as exc:
            raise ConfigError(f"{what} = {path!r} is not writable ({exc.strerror}); pass a "
                              f"directory this job can write") from None
        return
    base = _nearest_existing(os.path.dirname(full))
    if not os.path.isdir(base):
        raise ConfigError(f"{what} = {path!r} cannot be created: {base!r} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} = {path!r} cannot be created: {base!r} is not writable; "
                          f"pass a directory this job can write")


def check_environment(env: Mapping[str, str], cfg: Config, launch: LaunchInfo) -> None:
    """Read every variable init_world will read, and pick the device, as it will."""
    rpn = ranks_per_node_override(env, cfg.runtime.ranks_per_node)
    if rpn and launch.size % rpn:
        raise UsageError(f"HPCTRAIN_RANKS_PER_NODE={rpn}: the {launch.size} ranks launched are "
                         f"not divisible by it; launch a multiple of {rpn} ranks or unset it")
    mmap_threshold_kb(env)
    cpu_threads(env, 1, 1)
    env_flag("HPCTRAIN_CKPT_FORCE_SERIAL", env)
    comm_choice(env)
    select_device(launch.local_rank, env, cuda_count(), cfg.runtime.device)


def check_dataset(cfg: Config, dataset_len: int) -> None:
    """One global batch must fit in the data set (the sampler draws without replacement)."""
    gbs = cfg.train.global_batch_size
    if dataset_len < gbs:
        raise ConfigError(f"train.global_batch_size = {gbs} but the data set of "
                          f"{cfg.train.model!r} has only {dataset_len} samples; lower "
                          f"--global-batch-size to at most {dataset_len} or use more data")


def preflight(cfg: Config, env: Mapping[str, str], launch: LaunchInfo) -> None:
    """Run the checks that need neither MPI nor the model; raise ConfigError/UsageError."""
    c, t = cfg.checkpoint, cfg.train
    if c.resume and c.resume != "auto" and not os.path.isfile(c.resume):
        raise ConfigError(f"checkpoint.resume = {c.resume!r} does not exist; pass an existing "
                          f"ckpt-*.h5 file, or 'auto' (the newest in --checkpoint-dir)")
    if c.dir:
        check_writable_dir(c.dir, "checkpoint.dir (--checkpoint-dir)")
    if t.out_dir:
        check_writable_dir(t.out_dir, "train.out_dir (--out-dir)")
    if t.trace_dir:
        check_writable_dir(t.trace_dir, "train.trace_dir (--trace)")
    if t.summary:
        if os.path.isdir(t.summary):
            raise ConfigError(f"train.summary = {t.summary!r} is a directory; pass a file path")
        check_writable_dir(os.path.dirname(os.path.abspath(t.summary)),
                           f"the directory of train.summary = {t.summary!r}")
    data_dir = (env.get("HPCTRAIN_DATA_DIR") or "").strip()
    if data_dir and os.path.exists(data_dir) and not os.path.isdir(data_dir):
        raise UsageError(f"HPCTRAIN_DATA_DIR={data_dir!r} is a file, not a directory")
    check_environment(env, cfg, launch)
    check_optimizer(t, cfg.plan(launch.size).flavour)
    check_schedule(t)
