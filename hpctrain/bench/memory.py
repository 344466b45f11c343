"""Peak memory per rank of each strategy vs the ZeRO formula and torch FSDP2 (gloo).

Run under mpirun (e.g. ``mpirun -n 2 python -m hpctrain bench memory``); every strategy
runs in freshly spawned ranks (peak RSS never goes down within a process); rank 0 prints.
"""

from __future__ import annotations

import os

from hpctrain.bench.fresh import spawn
from hpctrain.bench.workload import ENTRIES, formula_bytes, resolve

__all__ = ["DEFAULT", "run"]

DEFAULT = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp2")


def _targeted(s: str) -> bool:
    """hpctrain's sharded flavours (zero1-3, fsdp FULL_SHARD/SHARD_GRAD_OP) have a target."""
    return ENTRIES[s].role == "dp" and ENTRIES[s].memory != "replicated"


def _mb(b: float) -> str:
    return f"{b / 2**20:8.1f}"


def run(params_m: float = 20.0, steps: int = 3, strategies=DEFAULT, width: int = 1024,
        mmap_threshold_kb: int | None = 256) -> int:
    """Measure each strategy after a few AdamW steps; print MB above baseline, formula, ratio."""
    from hpctrain.runtime.world import init_world

    world = init_world(device="cpu")
    n = world.size
    todo = [s for s in dict.fromkeys(map(resolve, strategies))
            if ENTRIES[s].ranks == "any" or n == 1]  # single is a 1-rank run
    res = {s: spawn(world.mpi_comm, "hpctrain.bench.workload",
                    {"strategy": s, "params_m": params_m, "width": width, "warmup": 0,
                     "steps": steps, "mmap_threshold_kb": mmap_threshold_kb}) for s in todo}
    if world.rank == 0 and res:
        any_ = next(iter(res.values()))
        psi, unit, kb = any_["psi"], any_["unit_bytes"], any_["mmap_threshold_kb"]
        print(f"memory bench: {psi / 1e6:.1f}M fp32 params ({any_['layers']} x Linear "
              f"{any_['width']}), AdamW, {steps} steps, {n} ranks, fresh ranks per strategy, "
              f"glibc mmap threshold {f'{kb} KB' if kb else 'dynamic'},"
              f" load average {os.getloadavg()[0]:.2f}")
        print(f"  {'strategy':<9} {'train peak MB':>13} {'formula MB':>10} {'measured/formula':>17}"
              f" {'build peak MB':>14} {'build target MB':>16} {'build/target':>13}"
              f"   (max over ranks of peak RSS above the pre-model RSS)")
        for s, r in res.items():
            peak, f = max(r["rss_above"]), formula_bytes(s, psi, n, unit)
            build = max(r["build_above"])
            line = (f"  {s:<9} {_mb(peak):>13} {_mb(f):>10} {peak / f:>17.2f}"
                    f"{'  (target <= 1.10)' if _targeted(s) else '                  '}"
                    f" {_mb(build):>14}")
            if ENTRIES[s].memory == "sharded" and ENTRIES[s].role == "dp":
                # deferred init: what the rank holds once built (its parameter shard and the
                # optimizer state torch's AdamW allocates at construction) + one gathered unit
                target = max(m["params"] + m["grads"] + m["optimizer"]
                             for m in r["built_report"]) + unit
                verdict = "PASS" if build <= 1.10 * target else "FAIL"
                line += f" {_mb(target):>16} {build / target:>8.2f} {verdict}"
            print(line)
        print("  build target (zero3, fsdp; deferred init): the rank's state once built "
              "(memory_report: parameter shard + AdamW state, which torch allocates at "
              "construction) + one gathered unit; target build/target <= 1.10")
        if "zero3" in res and "fsdp2" in res:
            z, t = max(res["zero3"]["rss_above"]), max(res["fsdp2"]["rss_above"])
            print(f"  peak memory zero3/fsdp2 = {z / t:.2f}x")
        if "fsdp" in res and "fsdp2" in res:
            z, t = max(res["fsdp"]["rss_above"]), max(res["fsdp2"]["rss_above"])
            print(f"  peak memory fsdp/fsdp2 = {z / t:.2f}x")
        for s, r in res.items():
            m = r["memory_report"]
            if m:
                total = m["params"] + m["grads"] + m["optimizer"] + m.get("largest_gathered_unit", 0)
                print(f"  {s} memory_report MB: params {_mb(m['params']).strip()}, grads "
                      f"{_mb(m['grads']).strip()}, optimizer {_mb(m['optimizer']).strip()}, "
                      f"gathered unit {_mb(m.get('largest_gathered_unit', 0)).strip()}, total "
                      f"{_mb(total).strip()} = {total / formula_bytes(s, psi, n, unit):.2f}"
                      f" x formula")
    world.mpi_comm.Barrier()
    return 0
