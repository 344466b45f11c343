"""Step time of hpctrain's data-parallel flavours against torch's own DDP and FSDP2 (gloo) and
against the compute floor (no communication): same model, same batch, same AdamW.

Run under mpirun (e.g. ``mpirun -n 2 python -m hpctrain bench step``); every strategy runs in
freshly spawned ranks; rank 0 prints the median step time of each and the ratios of this run,
each with its target (``RATIOS``); ``json_path`` also writes them as JSON.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hpctrain.bench.fresh import spawn

__all__ = ["DEFAULT", "RATIOS", "Ratio", "ratios", "report", "run"]

DEFAULT = ("nocomm", "torchddp", "ddp", "zero1", "zero2", "zero3", "fsdp", "fsdp:NO_SHARD",
           "pp2:ddp", "pp2:zero3")


@dataclass(frozen=True)
class Ratio:
    """median(numerator) / median(baseline) for each numerator run, with an upper target
    (None: printed for information). ``numerators``: entry names, or "role:R" for every entry
    of role R (workload.Entry.role) in the order they ran."""

    kind: str
    numerators: tuple
    baseline: str
    target: float | None


RATIOS = (
    Ratio("vs torch DDP", ("role:dp",), "torchddp", 1.00),
    Ratio("NO_SHARD vs Horovod ddp", ("fsdp:NO_SHARD",), "ddp", 1.05),
    Ratio("overlap", ("ddp", "zero1", "zero2"), "nocomm", 1.10),
    Ratio("vs torch FSDP2", ("zero3",), "fsdp2", 1.00),
    Ratio("vs torch FSDP2", ("fsdp",), "fsdp2", None),
)


def _numerators(r: Ratio, ran) -> list:
    from hpctrain.bench.workload import ENTRIES

    out = []
    for n in r.numerators:
        names = ([s for s in ran if ENTRIES[s].role == n[5:]] if n.startswith("role:")
                 else [n] if n in ran else [])
        out += [s for s in names if s != r.baseline and s not in out]
    return out


def ratios(medians: dict) -> tuple[list, list]:
    """(ratios, skipped) from {name: median seconds}: one dict per ratio whose numerator and
    baseline both ran; one per ratio whose numerator ran without its baseline (never a guess)."""
    done, skipped = [], []
    for r in RATIOS:
        for s in _numerators(r, medians):
            name = f"{s}/{r.baseline}"
            if r.baseline not in medians:
                skipped.append({"name": name, "kind": r.kind, "target": r.target,
                                "reason": f"baseline {r.baseline} not run"})
                continue
            value = medians[s] / medians[r.baseline]
            done.append({"name": name, "numerator": s, "baseline": r.baseline, "kind": r.kind,
                         "value": value, "target": r.target,
                         "pass": None if r.target is None else round(value, 2) <= r.target})
    return done, skipped


def _verdict(d: dict) -> str:
    if d["target"] is None:
        return "(no target)"
    return f"(target <= {d['target']:.2f}, {d['kind']})  {'PASS' if d['pass'] else 'MISS'}"


def report(res: dict, ranks: int, batch: int, steps: int, warmup: int,
           load: float) -> tuple[list, dict]:
    """(lines to print, JSON-able dict) from {name: workload.measure result}."""
    any_ = next(iter(res.values()))
    kb = any_["mmap_threshold_kb"]
    lines = [f"step bench: {any_['psi'] / 1e6:.1f}M fp32 params ({any_['layers']} x Linear "
             f"{any_['width']}), batch {batch}/rank, AdamW, median of {steps} steps after "
             f"{warmup}, {ranks} ranks, glibc mmap threshold "
             f"{f'{kb} KB' if kb else 'dynamic'}, load average {load:.2f}"]
    w = max(len(s) for s in res)
    lines.append(f"  {'strategy':<{w}} {'median ms':>10}   (every timed step, ms)")
    for s, r in res.items():
        lines.append(f"  {s:<{w}} {r['median_s'] * 1e3:10.1f}   ("
                     f"{' '.join(f'{t * 1e3:.0f}' for t in r['step_s'])})")
    done, skipped = ratios({s: r["median_s"] for s, r in res.items()})
    lines += [f"  step time {d['name']} = {d['value']:.2f}x  {_verdict(d)}" for d in done]
    lines += [f"  step time {d['name']}: skipped, {d['reason']}" for d in skipped]
    out = {"bench": "step", "ranks": ranks, "psi": any_["psi"], "layers": any_["layers"],
           "width": any_["width"], "batch": batch, "steps": steps, "warmup": warmup,
           "mmap_threshold_kb": kb, "load_average": load,
           "strategies": {s: {"median_s": r["median_s"], "step_s": r["step_s"]}
                          for s, r in res.items()},
           "ratios": done, "skipped": skipped}
    return lines, out


def run(params_m: float = 20.0, steps: int = 10, warmup: int = 3, batch: int = 32,
        strategies=DEFAULT, width: int = 1024, json_path: str = "") -> int:
    """Time warmup+steps AdamW steps per strategy; print medians and the ratios of RATIOS
    (rank 0); write them to json_path too when given."""
    from hpctrain.bench.workload import resolve
    from hpctrain.runtime.world import init_world

    strategies = tuple(dict.fromkeys(resolve(s) for s in strategies))
    world = init_world(device="cpu")
    res = {s: spawn(world.mpi_comm, "hpctrain.bench.workload",
                    {"strategy": s, "params_m": params_m, "width": width, "batch": batch,
                     "warmup": warmup, "steps": steps}) for s in strategies}
    if world.rank == 0 and res:
        lines, out = report(res, world.size, batch, steps, warmup, os.getloadavg()[0])
        print("\n".join(lines))
        if json_path:
            with open(json_path, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
            print(f"  wrote {json_path}")
    world.mpi_comm.Barrier()
    return 0
