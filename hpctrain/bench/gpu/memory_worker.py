"""The ranks of the GPU check's memory part (started under mpirun by memory.py).

``python -m hpctrain.bench.gpu.memory_worker JSON``; JSON: {"mode": "train" | "build", ...}.
Rank 0 prints one line ``RESULT <json>`` with every rank's figures.

- ``train``: for each strategy in turn, in these same processes (CUDA's peak counter is
  reset per strategy, unlike a process's peak RSS): the Linear stack of bench/workload.py
  (deferred init for zero3/fsdp, as train builds them), wrapped, ``steps`` AdamW steps;
  per rank the peak of ``torch.cuda.max_memory_allocated`` above the allocation before the
  model, and the strategy's memory_report. On cpu the same code runs and the device
  figures are None.
- ``build``: zero3 builds a big stack with deferred init (no optimizer state: SGD without
  momentum; no step); per rank the build's peak above the allocation before the model,
  the rank's shard (memory_report) and the seconds the build took.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _clean(dev) -> int:
    """Free what the last strategy left; the allocation now (the baseline)."""
    gc.collect()
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _peak(dev):
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev)


def _train(world, a: dict) -> dict:
    from hpctrain.bench.workload import ENTRIES, build_stack, layers_for, train_step

    dev = world.device
    # cuBLAS allocates its workspace through the caching allocator at the first matmul: in
    # every strategy's baseline, not in the first one's peak
    w = torch.randn(64, 64, device=dev, requires_grad=True)
    (w @ w).sum().backward()
    del w
    out = {}
    for s in a["strategies"]:
        entry = ENTRIES[s]
        base = _clean(dev)
        world.mpi_comm.Barrier()
        t0 = time.perf_counter()
        model = build_stack(a["width"], layers_for(a["params_m"], a["width"]),
                            deferred=entry.memory == "sharded")
        psi = sum(p.numel() for p in model.parameters())
        unit = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
        # foreach=False: torch's foreach AdamW (its default for CUDA tensors) allocates
        # temporaries the size of every shard at once, which is torch's, not the strategy's
        par = entry.build(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
                          world)
        del model
        _sync(dev)
        build_s = time.perf_counter() - t0
        build_peak = _peak(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        g = torch.Generator().manual_seed(1 + world.rank)
        x = torch.randn(a["batch"], a["width"], generator=g).to(dev)
        for _ in range(a["steps"]):
            train_step(par, x)
        peak = _peak(dev)
        report = par.memory_report()
        del par, x
        res = {"psi": psi, "unit_bytes": unit, "build_s": build_s,
               "build_above": None if build_peak is None else build_peak - base,
               "train_above": None if peak is None else peak - base, "memory_report": report}
        out[s] = world.mpi_comm.allgather(res)
    return out


def _build(world, a: dict) -> dict:
    from hpctrain.bench.workload import ENTRIES, build_stack

    dev = world.device
    base = _clean(dev)
    world.mpi_comm.Barrier()
    t0 = time.perf_counter()
    model = build_stack(a["width"], a["layers"], deferred=True)
    psi = sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
    par = ENTRIES["zero3"].build(model, lambda ps: torch.optim.SGD(ps, lr=1e-4), world)
    del model
    _sync(dev)
    build_s = time.perf_counter() - t0
    peak = _peak(dev)
    report = par.memory_report()
    res = {"psi": psi, "unit_bytes": unit, "build_s": build_s,
           "build_above": None if peak is None else peak - base,
           "shard_bytes": report["params"], "memory_report": report,
           "total_memory": (torch.cuda.get_device_properties(dev).total_memory
                            if dev.type == "cuda" else None)}
    return {"zero3": world.mpi_comm.allgather(res)}


def main() -> int:
    a = json.loads(sys.argv[1])
    from hpctrain.runtime.world import init_world

    world = init_world(device=a["device"])
    if world.device.type == "cuda":  # two ranks share the node's cores for the CPU-side init
        cores = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, cores // max(1, world.local_size)))
    out = (_train if a["mode"] == "train" else _build)(world, a)
    if a.get("then_build"):  # cpu --tiny: the build item's run in the same launch
        out["build"] = _build(world, {**a, **a["then_build"]})["zero3"]
    if world.rank == 0:
        print("RESULT " + json.dumps({"world_size": world.size, "comm": world.comm.backend,
                                      "device": str(world.device), "results": out}),
              flush=True)
    world.mpi_comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
