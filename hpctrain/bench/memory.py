"""Peak memory per rank of each strategy vs the ZeRO formula and torch FSDP2 (gloo).

Run under mpirun (e.g. ``mpirun -n 2 python -m hpctrain bench memory``); every strategy
runs in freshly spawned ranks (peak RSS never goes down within a process); rank 0 prints.

The sharded flavours (zero1-3, fsdp) are held to ``TARGET`` x (formula + buffers): the
buffers are the transients besides the formula's states, as ``memory_report`` gives their
limits: the gradient reduction's in-flight buffers (``reduce_bucket_size``, with what the
MPI backend stages to receive), the unit backward prefetch may gather ahead
(``allgather_bucket_size``) and a unit's full gradients while its backward runs. The peak is
measured (VmHWM), the budget computed.
"""

from __future__ import annotations

import os

from hpctrain.bench.fresh import spawn
from hpctrain.bench.workload import ENTRIES, formula_bytes, resolve

__all__ = ["DEFAULT", "run"]

DEFAULT = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp2")
TARGET = 1.05  # measured peak / (formula + buffers), the sharded flavours


def _targeted(s: str) -> bool:
    """hpctrain's sharded flavours (zero1-3, fsdp FULL_SHARD/SHARD_GRAD_OP) have a target."""
    return ENTRIES[s].role == "dp" and ENTRIES[s].memory != "replicated"


def _mb(b: float) -> str:
    return f"{b / 2**20:8.1f}"


def buffers_bytes(report: dict) -> int:
    """The transient buffers a sharded strategy holds besides the formula (its
    memory_report's limits): the reduction's buffers (reduce_bucket_size), the unit backward
    prefetch may gather ahead (allgather_bucket_size) and, where gradients are reduced during
    backward, the full gradients of the unit whose backward runs (until its reduction)."""
    return (report.get("reduce_buffers_limit", 0) + report.get("prefetch_buffer", 0) +
            report.get("unit_grads_limit", 0))


def run(params_m: float = 20.0, steps: int = 3, strategies=DEFAULT, width: int = 1024,
        mmap_threshold_kb: int | None = 256, buckets: dict | None = None) -> int:
    """Measure each strategy after a few AdamW steps; print MB above baseline, formula, ratio,
    and for the sharded flavours the ratio to formula + buffers with its verdict."""
    from hpctrain.runtime.world import init_world

    world = init_world(device="cpu")
    n = world.size
    todo = [s for s in dict.fromkeys(map(resolve, strategies))
            if ENTRIES[s].ranks == "any" or n == 1]  # single is a 1-rank run
    res = {s: spawn(world.mpi_comm, "hpctrain.bench.workload",
                    {"strategy": s, "params_m": params_m, "width": width, "warmup": 0,
                     "steps": steps, "mmap_threshold_kb": mmap_threshold_kb,
                     "buckets": buckets or {}}) for s in todo}
    if world.rank == 0 and res:
        any_ = next(iter(res.values()))
        psi, unit, kb = any_["psi"], any_["unit_bytes"], any_["mmap_threshold_kb"]
        print(f"memory bench: {psi / 1e6:.1f}M fp32 params ({any_['layers']} x Linear "
              f"{any_['width']}), AdamW, {steps} steps, {n} ranks, fresh ranks per strategy, "
              f"glibc mmap threshold {f'{kb} KB' if kb else 'dynamic'},"
              f" load average {os.getloadavg()[0]:.2f}"
              + "".join(f", {k} {v}" for k, v in (buckets or {}).items()))
        print(f"  {'strategy':<9} {'train peak MB':>13} {'formula MB':>10} {'measured/formula':>17}"
              f" {'buffers MB':>10} {'measured/(f+b)':>15}        "
              f" {'build peak MB':>14} {'build target MB':>16} {'build/target':>13}"
              f"   (max over ranks of peak RSS above the pre-model RSS)")
        verdicts = []
        for s, r in res.items():
            peak, f = max(r["rss_above"]), formula_bytes(s, psi, n, unit)
            build = max(r["build_above"])
            line = f"  {s:<9} {_mb(peak):>13} {_mb(f):>10} {peak / f:>17.2f}"
            if _targeted(s) and r["memory_report"]:
                b = buffers_bytes(r["memory_report"])
                ratio = peak / (f + b)
                verdict = "PASS" if ratio <= TARGET else "FAIL"
                verdicts.append(verdict)
                line += f" {_mb(b):>10} {ratio:>15.2f} {verdict:<6}"
            else:
                line += f" {'':>10} {'':>15} {'':<6}"
            line += f" {_mb(build):>14}"
            if ENTRIES[s].memory == "sharded" and ENTRIES[s].role == "dp":
                # deferred init: what the rank holds once built (its parameter shard and the
                # optimizer state torch's AdamW allocates at construction) + one gathered unit
                target = max(m["params"] + m["grads"] + m["optimizer"]
                             for m in r["built_report"]) + unit
                verdict = "PASS" if build <= 1.10 * target else "FAIL"
                line += f" {_mb(target):>16} {build / target:>8.2f} {verdict}"
            print(line)
        print(f"  buffers (zero1-3, fsdp): the gradient reduction's limit for reduce_bucket_size "
              f"(B + B(N-1)/N: piece buffers + what MPI stages to receive; zero1: its step's "
              f"whole-unit reduce-scatter, 3 shards of a unit) + the unit backward prefetch "
              f"may gather ahead (allgather_bucket_size) + zero2/zero3/fsdp: a unit's full "
              f"gradients, alive until its reduction starts; target measured/(formula + "
              f"buffers) <= {TARGET:.2f}: "
              + (f"{verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL"
                 if verdicts else "none measured"))
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
                      f" x formula; buffers measured: reduction "
                      f"{_mb(m.get('reduce_buffers', 0)).strip()} (limit "
                      f"{_mb(m.get('reduce_buffers_limit', 0)).strip()}), prefetched "
                      f"{_mb(m.get('peak_prefetched', 0)).strip()} (limit "
                      f"{_mb(m.get('prefetch_buffer', 0)).strip()}), full gradients "
                      f"{_mb(m.get('unit_grads', 0)).strip()} (limit "
                      f"{_mb(m.get('unit_grads_limit', 0)).strip()})")
    world.mpi_comm.Barrier()
    return 0
