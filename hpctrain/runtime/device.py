"""Pick this rank's device (GPU by local rank, or CPU with a fair share of threads)."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from hpctrain.errors import EnvError, UsageError

__all__ = ["positive_int_env", "cpu_threads", "select_device", "bind_device", "available_cpus",
           "cuda_count"]

_NO_GPU_FIX = (
    "run on a GPU node and request GPUs from the scheduler (e.g. srun --gpus-per-task=1, "
    "or PBS -l select=...:ngpus=N), check that CUDA_VISIBLE_DEVICES is not empty, install a "
    "CUDA build of torch, or set HPCTRAIN_DEVICE=cpu")


def positive_int_env(env: Mapping[str, str], name: str) -> int | None:
    """Return the positive integer in ``env[name]``, None when unset; ValueError when malformed."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    # OMP_NUM_THREADS may list one count per nesting level ("8,2"); the first is ours.
    head = raw.split(",")[0].strip() if name == "OMP_NUM_THREADS" else raw
    try:
        value = int(head)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a positive integer; set one or unset it") from None
    if value < 1:
        raise EnvError(f"{name}={raw!r} is not a positive integer; set one or unset it")
    return value


def cpu_threads(env: Mapping[str, str], local_size: int, cpu_count: int) -> int:
    """Return the intra-op thread count for one rank on a node shared by ``local_size`` ranks.

    SLURM_CPUS_PER_TASK (what Slurm actually gave each task) wins, then an explicit
    OMP_NUM_THREADS, else the node's CPUs split evenly so ranks do not oversubscribe cores.
    """
    if local_size < 1:
        raise ValueError(f"local_size={local_size} must be at least 1")
    for name in ("SLURM_CPUS_PER_TASK", "OMP_NUM_THREADS"):
        value = positive_int_env(env, name)
        if value is not None:
            return value
    return max(1, int(cpu_count or 1) // local_size)


def _visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """Return the CUDA_VISIBLE_DEVICES entries, or None when it is not set."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def select_device(local_rank: int, env: Mapping[str, str], cuda_device_count: int,
                  requested: str = "auto") -> str:
    """Return ``"cuda:N"`` or ``"cpu"`` for this rank.

    ``requested`` (runtime.device / --device) wins over HPCTRAIN_DEVICE=cpu|cuda; "auto"
    takes a GPU when one is visible. ``cuda_device_count`` is what torch sees, which already
    honours CUDA_VISIBLE_DEVICES; ranks share GPUs round-robin by local rank.
    """
    source = f"runtime.device = {requested!r} (--device)"
    forced = requested.strip().lower() if requested not in ("", "auto") else ""
    if not forced:
        forced = (env.get("HPCTRAIN_DEVICE") or "").strip().lower()
        source = f"HPCTRAIN_DEVICE={env.get('HPCTRAIN_DEVICE')!r}"
        if forced not in ("", "auto", "cpu", "cuda"):
            raise EnvError(f"{source} is not one of cpu, cuda, auto; fix: set it to one of "
                           "those or unset it")
    if forced not in ("", "auto", "cpu", "cuda"):
        raise UsageError(f"{source} is not one of auto, cpu, cuda")
    if forced == "cpu":
        return "cpu"
    if cuda_device_count < 1:
        if forced == "cuda":
            raise UsageError(
                f"{source} but no CUDA device is visible (device count 0, "
                f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}); fix: {_NO_GPU_FIX}")
        return "cpu"
    if local_rank < 0:
        raise ValueError(f"local_rank={local_rank} must be >= 0")
    visible = _visible_devices(env)
    # One GPU per rank (srun --gpus-per-task, per-rank wrapper scripts): it is always index 0,
    # even if the caller counted every GPU on the node.
    if visible is not None and len(visible) == 1:
        return "cuda:0"
    return f"cuda:{local_rank % cuda_device_count}"


def available_cpus() -> int:
    """Return how many CPUs this process may run on (its affinity mask, else the node's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def cuda_count() -> int:
    """GPUs torch can use in this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bind_device(local_rank: int, local_size: int, env: Mapping[str, str] | None = None,
                requested: str = "auto") -> torch.device:
    """Make this rank's device current (GPU) or size its thread pool (CPU); return the device."""
    env = os.environ if env is None else env
    name = select_device(local_rank, env, cuda_count(), requested)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # The affinity mask may already be shared by all local ranks (a job-wide cgroup),
        # so it is still split by local_size: fewer threads beat oversubscribed cores.
        torch.set_num_threads(cpu_threads(env, local_size, available_cpus()))
    return device
