"""One benchmark run in fresh processes: build a Linear stack, wrap it, train a few steps.

Started by ``fresh.spawn`` (``python -m hpctrain.bench.workload JSON``); returns peak RSS
above the pre-model baseline, step times and (ZeRO) the strategy's memory_report().
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
from torch import nn

__all__ = ["STRATEGIES", "Stack", "formula_bytes", "layers_for", "measure"]

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp2")


class Stack(nn.Module):
    """Square Linear layers in a ModuleList, so zero3 and FSDP2 get one unit per layer."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def layers_for(params_m: float, width: int) -> int:
    """Layers of the given width that hold about params_m million parameters."""
    return max(1, round(params_m * 1e6 / (width * width + width)))


def formula_bytes(strategy: str, psi: int, n: int, unit_bytes: int) -> int:
    """Per-rank bytes of fp32 params + grads + AdamW state (ZeRO paper, K=8 without AMP)."""
    if strategy in ("single", "ddp"):
        return 16 * psi
    if strategy == "zero1":
        return 4 * psi + 4 * psi + 8 * psi // n
    if strategy == "zero2":
        return 4 * psi + 12 * psi // n
    return 16 * psi // n + unit_bytes  # zero3, fsdp and FSDP2 (FULL_SHARD): + one gathered unit


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    # Linux >= 4.0: "5" resets VmHWM to the current RSS, so import-time peaks do not count.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then VmHWM may include an earlier peak: the figure errs high, not low


def _warm_up(strategy: str, world, batch: int) -> None:
    """A tiny model through the same strategy for two steps before the baseline is read.

    The first steps page in the code of what training runs (libtorch kernels, autograd
    hooks, the collectives: about 2 MB of file-backed pages) and the BLAS workspace: the
    libraries' memory, a fixed cost whatever the model's size. The tiny model's tensors are
    freed, and the heap holes they leave are trimmed, so that the measured model cannot
    reuse resident memory that the baseline already counted."""
    from hpctrain.runtime.malloc import release_free_heap

    width = 256  # its units are 256 KB: the ring reduce-scatter's path, as the model's
    par = _wrap(strategy, Stack(width, 2), lambda ps: torch.optim.AdamW(ps, lr=1e-4), world)
    x = torch.randn(batch, width)
    for _ in range(2):
        par.backward(par.model(x).square().mean())
        par.step()
    del par, x
    release_free_heap()


def _set_mmap_threshold(kb: int | None) -> None:
    # None: the runtime's default (HPCTRAIN_MMAP_THRESHOLD_KB, see runtime/malloc.py);
    # 0: glibc's dynamic threshold; N: N KB.
    if kb is not None:
        from hpctrain.runtime.malloc import ENV

        os.environ[ENV] = str(kb)


def _init_gloo(world) -> None:
    import torch.distributed as dist

    port = 0
    if world.rank == 0:  # a free port now, not a guess that a previous run still holds
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(world.mpi_comm.bcast(port))
    dist.init_process_group("gloo", rank=world.rank, world_size=world.size)


class _FSDP2:
    """torch FSDP2 (fully_shard per layer, then the root) with the same step interface."""

    def __init__(self, model, make_optimizer, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world.size,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = make_optimizer(model.parameters())

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad()


def _prepare(strategy: str, world) -> None:
    """Start the strategy's communication library before the baseline (not model memory)."""
    if strategy == "fsdp2":
        _init_gloo(world)
    elif strategy == "ddp":
        from hpctrain.parallel.ddp import DDPOptions, _init_horovod

        _init_horovod(world.mpi_comm, DDPOptions())


def _wrap(strategy: str, model, make_optimizer, world):
    if strategy == "fsdp2":
        return _FSDP2(model, make_optimizer, world)
    from hpctrain.parallel import wrap

    options = None
    if strategy == "fsdp":
        from hpctrain.parallel.fsdp import FSDPOptions

        options = FSDPOptions()
    if strategy.startswith("zero"):
        from hpctrain.parallel.zero import ZeroOptions

        options = ZeroOptions(stage=int(strategy[-1]))
    return wrap(strategy, model, make_optimizer, world, options)


def measure(strategy: str, params_m: float = 20.0, width: int = 1024, batch: int = 32,
            warmup: int = 2, steps: int = 3, mmap_threshold_kb: int | None = None) -> dict:
    """Train warmup+steps AdamW steps; return per-rank peak RSS above baseline and timings."""
    from hpctrain.runtime.world import init_world

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    _set_mmap_threshold(mmap_threshold_kb)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = init_world(device="cpu")
    from hpctrain.runtime.malloc import tune_malloc

    applied_kb = tune_malloc()
    _prepare(strategy, world)
    _warm_up(strategy, world, batch)
    world.mpi_comm.Barrier()
    base_kb = _status_kb("VmRSS")
    _reset_peak()

    torch.manual_seed(0)
    model = Stack(width, layers_for(params_m, width))
    psi = sum(p.numel() for p in model.parameters())
    unit_bytes = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
    layers = len(model.blocks)
    par = _wrap(strategy, model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), world)
    del model  # the wrapper holds what it keeps (ZeRO/FSDP2 free the full tensors)
    # Building the full model before sharding it is a peak of its own (meta-device init
    # avoids it); the formula describes training, so the training peak is read separately.
    build_kb = _status_kb("VmHWM")
    _reset_peak()
    g = torch.Generator().manual_seed(1 + world.rank)
    x = torch.randn(batch, width, generator=g)
    times = []
    for k in range(warmup + steps):
        world.mpi_comm.Barrier()
        t0 = time.perf_counter()
        par.backward(par.model(x).square().mean())
        par.step()
        world.mpi_comm.Barrier()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    above = (_status_kb("VmHWM") - base_kb) * 1024
    build = (build_kb - base_kb) * 1024
    report = par.memory_report() if hasattr(par, "memory_report") else None
    if strategy == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"strategy": strategy, "world_size": world.size, "psi": psi,
            "unit_bytes": unit_bytes, "layers": layers, "width": width,
            "rss_above": world.mpi_comm.allgather(above),
            "build_above": world.mpi_comm.allgather(build), "memory_report": report,
            "mmap_threshold_kb": applied_kb, "step_s": times, "median_s": statistics.median(times) if times else 0.0}


if __name__ == "__main__":
    from hpctrain.bench.fresh import serve

    serve(measure)
