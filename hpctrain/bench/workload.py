"""One benchmark run in fresh processes: build a Linear stack, wrap it, train a few steps.

What can be run is ``ENTRIES``: a name -> an ``Entry`` saying how to build it (hpctrain's
strategies, composed plans, torch DDP and FSDP2 over gloo, the no-communication floor).

Started by ``fresh.spawn`` (``python -m hpctrain.bench.workload JSON``); returns peak RSS
above the pre-model baseline, step times and (ZeRO) the strategy's memory_report().
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from hpctrain.bench.gloo_group import destroy_gloo, init_gloo
from hpctrain.parallel.base import Parallelized
from hpctrain import registry

__all__ = ["ENTRIES", "STRATEGIES", "Entry", "Stack", "formula_bytes", "layers_for", "measure",
           "resolve"]


class Stack(nn.Module):
    """Square Linear layers in a ModuleList, so zero3 and FSDP2 get one unit per layer."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def stack_layers(width: int, layers: int, seed: int = 0):
    """``Stack`` as a LayerStack: each Linear built alone under its own seed, so a sharded
    entry can build it with deferred init (parallel/deferred.py)."""
    from hpctrain.models.layers import LayerStack, PipeLayer, seeded

    def layer(i):
        return PipeLayer(f"blocks.{i}",
                         lambda: seeded(seed, i, lambda: {f"blocks.{i}": nn.Linear(width, width)}),
                         lambda root, x: torch.relu(root.blocks[i](x)))
    return LayerStack([layer(i) for i in range(layers)])


def build_stack(width: int, layers: int, deferred: bool = False) -> "Stack":
    """The Stack with its layers' seeded weights; ``deferred``: on the meta device, with
    placeholders each rank fills only where it keeps a part (the build peak of zero3/fsdp)."""
    stack = stack_layers(width, layers)
    with torch.device("meta"):
        model = Stack(width, layers)
    if deferred:
        from hpctrain.parallel.orchestrator import defer_init

        defer_init(model, stack)
        return model
    whole = stack.build(range(layers))  # real, layer by layer: the same values
    model.blocks = nn.ModuleList(whole.blocks[str(i)] for i in range(layers))
    return model


def layers_for(params_m: float, width: int) -> int:
    """Layers of the given width that hold about params_m million parameters."""
    return max(1, round(params_m * 1e6 / (width * width + width)))


def formula_bytes(strategy: str, psi: int, n: int, unit_bytes: int) -> int:
    """Per-rank bytes of fp32 params + grads + AdamW state (ZeRO paper, K=8 without AMP)."""
    memory = ENTRIES[resolve(strategy)].memory
    if memory == "replicated":  # single, nocomm, ddp, torchddp, fsdp:NO_SHARD
        return 16 * psi
    if memory == "zero1":
        return 4 * psi + 4 * psi + 8 * psi // n
    if memory == "zero2":  # zero2, fsdp:SHARD_GRAD_OP
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
    par = ENTRIES[strategy].build(Stack(width, 2), lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                  world)
    x = torch.randn(batch, width)
    for _ in range(2):
        train_step(par, x)
    del par, x
    release_free_heap()


def _set_mmap_threshold(kb: int | None) -> None:
    # None: the runtime's default (HPCTRAIN_MMAP_THRESHOLD_KB, see runtime/malloc.py);
    # 0: glibc's dynamic threshold; N: N KB.
    if kb is not None:
        from hpctrain.runtime.malloc import ENV

        os.environ[ENV] = str(kb)


class _FSDP2(Parallelized):
    """torch FSDP2 (fully_shard per layer, then the root) with the same step interface."""

    name = "fsdp2"
    memory_report = None  # torch's DTensors: no report of ours

    def __init__(self, model, make_optimizer, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world.size,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        super().__init__(model, make_optimizer(model.parameters()))


class _TorchDDP(Parallelized):
    """torch.nn.parallel.DistributedDataParallel over gloo, torch's defaults (25 MB buckets,
    all-reduces started from autograd hooks during backward)."""

    name = "torchddp"
    memory_report = None  # torch's wrapper: no report of ours

    def __init__(self, model, make_optimizer, world):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(DistributedDataParallel(model), make_optimizer(model.parameters()))


class _NoComm(Parallelized):
    """The compute floor: the same forward, backward and AdamW step, no communication at all
    (every rank trains its own copy, concurrently with the others)."""

    name = "nocomm"


def _no_comm(model, make_optimizer, world):
    return _NoComm(model, make_optimizer(model.parameters()))


def _nothing(world) -> None:
    pass


def _pipelined(flavour: str):
    """A composed plan: pp=2 stages of the same Linear stack (as nn.Sequential), the dp
    flavour over each stage's replicas (dp = world size / 2), 4 pipeline micro-batches."""
    def build(model, make_optimizer, world):
        from hpctrain.parallel import wrap
        from hpctrain.parallel.pipeline import PipelineOptions

        seq = nn.Sequential(*(nn.Sequential(b, nn.ReLU()) for b in model.blocks))
        opts = PipelineOptions(mesh="pp=2", dp_sharding=flavour, microbatches=4)
        with contextlib.redirect_stdout(io.StringIO()):  # the plan's log lines, per build
            return wrap("pipeline", seq, make_optimizer, world, opts)
    return build


def train_step(par, x) -> None:
    """One step on batch x (loss: mean square of the output) through the object's own path:
    a plan with a pipeline runs its schedule (forward_backward), the others backward()."""
    if getattr(par, "executor", None) is not None:
        from hpctrain.train.precision import Precision

        par.forward_backward([(x, x, 1.0)], lambda out, _y: out.square().mean(),
                             Precision("fp32", x.device))
    else:
        par.backward(par.model(x).square().mean())
    par.step()


def _start_horovod(world) -> None:
    from hpctrain.parallel.ddp import DDPOptions, _init_horovod

    _init_horovod(world.mpi_comm, DDPOptions())


def _ours(strategy: str, options=None):
    """Build through hpctrain.parallel.wrap(strategy, ..., options)."""
    def build(model, make_optimizer, world):
        from hpctrain.parallel import wrap

        return wrap(strategy, model, make_optimizer, world, options() if options else None)
    return build


# Bucket sizes for the sharded entries' options ({"reduce_bucket_size": ..., ...}), set by
# ``measure`` from its arguments (empty: the options' defaults).
_BUCKETS: dict = {}


def _flavour_options(f):
    """The flavour's options as its config section's defaults make them, with the bench's
    bucket sizes (None for ddp: its defaults)."""
    if f.stage is not None:
        return _zero_options(f.stage)
    if f.table == "fsdp":
        return _fsdp_options("FULL_SHARD")
    return None


def _fsdp_options(sharding: str):
    def options():
        from hpctrain.parallel.fsdp import FSDPOptions

        return FSDPOptions(sharding_strategy=sharding, **_BUCKETS)
    return options


def _zero_options(stage: int):
    def options():
        from hpctrain.parallel.zero import ZeroOptions

        return ZeroOptions(stage=stage, **{k: v for k, v in _BUCKETS.items()
                                           if k == "reduce_bucket_size"})
    return options


@dataclass(frozen=True)
class Entry:
    """One thing the benchmarks can time: a name and how to build it.

    ``build(model, make_optimizer, world)`` returns an object with ``model``, ``backward(loss)``
    and ``step()`` (a Parallelized); ``prepare(world)`` starts its communication library before
    the memory baseline is read (library memory is not model memory), ``finish(world)`` stops it.
    ``memory`` names the per-rank formula (``formula_bytes``): "replicated" (16 psi), "zero1",
    "zero2" or "sharded" (16 psi / n + one gathered unit). ``role``: "dp" for hpctrain's own
    data-parallel flavours (compared with torch DDP), "torch" for torch's baselines, "floor"
    for the no-communication floor, "single" for the 1-rank reference, "composed" for plans
    of several parallelisms (pp=2 x a dp flavour), timed without a target yet.
    """

    name: str
    build: Callable
    memory: str
    role: str
    prepare: Callable = _nothing
    finish: Callable = _nothing
    ranks: str = "any"  # "one": runs on one rank only (single)


def _entries() -> dict:
    gloo = {"prepare": init_gloo, "finish": destroy_gloo}
    out = [
        Entry("single", _ours("single"), "replicated", "single", ranks="one"),
        Entry("nocomm", _no_comm, "replicated", "floor"),
        # every data-parallel flavour of the registry, as its config defaults build it
        *(Entry(f.name, _ours(f.name, _flavour_options(f)), f.memory, "dp",
                **({"prepare": _start_horovod} if f.name == "ddp" else {}))
          for f in registry.FLAVOURS),
        Entry("fsdp:SHARD_GRAD_OP", _ours("fsdp", _fsdp_options("SHARD_GRAD_OP")), "zero2", "dp"),
        Entry("fsdp:NO_SHARD", _ours("fsdp", _fsdp_options("NO_SHARD")), "replicated", "dp"),
        Entry("fsdp2", _FSDP2, "sharded", "torch", **gloo),
        Entry("torchddp", _TorchDDP, "replicated", "torch", **gloo),
        # composed plans (timed for information: no target yet)
        Entry("pp2:ddp", _pipelined("ddp"), "replicated", "composed"),
        Entry("pp2:zero2", _pipelined("zero2"), "zero2", "composed"),
        Entry("pp2:zero3", _pipelined("zero3"), "sharded", "composed"),
    ]
    return {e.name: e for e in out}


ENTRIES = _entries()
STRATEGIES = tuple(ENTRIES)


def resolve(name: str) -> str:
    """The entry's name as registered (``fsdp:no_shard`` -> ``fsdp:NO_SHARD``; fsdp:FULL_SHARD
    -> fsdp); ValueError for a name that is not one."""
    key = name.strip()
    if key.lower() == "fsdp:full_shard":
        return "fsdp"
    for n in ENTRIES:
        if n.lower() == key.lower():
            return n
    raise ValueError(f"strategy {name!r}: expected one of {', '.join(STRATEGIES)}")


def measure(strategy: str, params_m: float = 20.0, width: int = 1024, batch: int = 32,
            warmup: int = 2, steps: int = 3, mmap_threshold_kb: int | None = None,
            buckets: dict | None = None) -> dict:
    """Train warmup+steps AdamW steps; return per-rank peak RSS above baseline and timings.
    ``buckets``: reduce_bucket_size / allgather_bucket_size for the sharded entries."""
    from hpctrain.runtime.world import init_world

    _BUCKETS.clear()
    _BUCKETS.update(buckets or {})
    strategy = resolve(strategy)
    entry = ENTRIES[strategy]
    _set_mmap_threshold(mmap_threshold_kb)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = init_world(device="cpu")
    from hpctrain.runtime.malloc import tune_malloc

    applied_kb = tune_malloc()
    entry.prepare(world)
    _warm_up(strategy, world, batch)
    world.mpi_comm.Barrier()
    base_kb = _status_kb("VmRSS")
    _reset_peak()

    # zero3 and fsdp FULL_SHARD build with deferred init, as train does: no rank holds the
    # whole model at any time
    model = build_stack(width, layers_for(params_m, width), deferred=entry.memory == "sharded"
                        and entry.role == "dp")
    psi = sum(p.numel() for p in model.parameters())
    unit_bytes = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
    layers = len(model.blocks)
    par = entry.build(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), world)
    del model  # the wrapper holds what it keeps (ZeRO/FSDP2 free the full tensors)
    # The build peak (deferred init for zero3/fsdp: the rank's shard + a layer at a time) is
    # read apart from training's: the formula describes training.
    build_kb = _status_kb("VmHWM")
    # what the rank holds once built (its shards; torch's AdamW allocates its state now)
    built_report = par.memory_report() if callable(getattr(par, "memory_report", None)) else None
    _reset_peak()
    g = torch.Generator().manual_seed(1 + world.rank)
    x = torch.randn(batch, width, generator=g)
    times = []
    for k in range(warmup + steps):
        world.mpi_comm.Barrier()
        t0 = time.perf_counter()
        train_step(par, x)
        world.mpi_comm.Barrier()
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    above = (_status_kb("VmHWM") - base_kb) * 1024
    build = (build_kb - base_kb) * 1024
    report = par.memory_report() if callable(getattr(par, "memory_report", None)) else None
    entry.finish(world)
    return {"strategy": strategy, "world_size": world.size, "psi": psi,
            "unit_bytes": unit_bytes, "layers": layers, "width": width,
            "rss_above": world.mpi_comm.allgather(above),
            "build_above": world.mpi_comm.allgather(build), "memory_report": report,
            "built_report": world.mpi_comm.allgather(built_report),
            "mmap_threshold_kb": applied_kb, "step_s": times, "median_s": statistics.median(times) if times else 0.0}


if __name__ == "__main__":
    from hpctrain.bench.fresh import serve

    serve(measure)
