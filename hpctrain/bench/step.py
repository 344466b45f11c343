"""Step time of zero3 vs torch FSDP2 (gloo), ddp for reference: same model, same batch.

Run under mpirun (e.g. ``mpirun -n 2 python -m hpctrain bench step``); every strategy
runs in freshly spawned ranks; rank 0 prints the median step time of each and the ratio.
"""

from __future__ import annotations

import os

from hpctrain.bench.fresh import spawn

__all__ = ["DEFAULT", "run"]

DEFAULT = ("zero3", "fsdp", "fsdp2", "ddp")


def run(params_m: float = 20.0, steps: int = 10, warmup: int = 3, batch: int = 32,
        strategies=DEFAULT, width: int = 1024) -> int:
    """Time warmup+steps AdamW steps per strategy; print medians and zero3/fsdp2."""
    from hpctrain.runtime.world import init_world

    world = init_world(device="cpu")
    res = {s: spawn(world.mpi_comm, "hpctrain.bench.workload",
                    {"strategy": s, "params_m": params_m, "width": width, "batch": batch,
                     "warmup": warmup, "steps": steps}) for s in strategies}
    if world.rank == 0 and res:
        any_ = next(iter(res.values()))
        kb = any_["mmap_threshold_kb"]
        print(f"step bench: {any_['psi'] / 1e6:.1f}M fp32 params ({any_['layers']} x Linear "
              f"{any_['width']}), batch {batch}/rank, AdamW, median of {steps} steps after "
              f"{warmup}, {world.size} ranks, glibc mmap threshold "
              f"{f'{kb} KB' if kb else 'dynamic'}, load average {os.getloadavg()[0]:.2f}")
        for s, r in res.items():
            print(f"  {s:<6} {r['median_s'] * 1e3:8.1f} ms   (all: "
                  f"{' '.join(f'{t * 1e3:.0f}' for t in r['step_s'])})")
        if "zero3" in res and "fsdp2" in res:
            ratio = res["zero3"]["median_s"] / res["fsdp2"]["median_s"]
            print(f"  step time zero3/fsdp2 = {ratio:.2f}x  (target <= 1.0)")
        if "fsdp" in res and "fsdp2" in res:
            ratio = res["fsdp"]["median_s"] / res["fsdp2"]["median_s"]
            print(f"  step time fsdp/fsdp2 = {ratio:.2f}x")
    world.mpi_comm.Barrier()
    return 0
