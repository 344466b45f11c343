"""Train many configurations in ONE process (under mpirun or alone) and write their summaries.

``python fsdp_worker.py OUT.json CASES.json``: CASES is a list of {"id", "overrides"} where
overrides are config tables ({"train": {...}, "fsdp": {...}}). Startup (torch, MPI) is paid
once for all of them. Rank 0 writes {id: {losses, param_norm, buffer_norm, units, ...}}.
"""

import json
import sys

from hpctrain.config import load_config
from hpctrain.runtime.world import init_world
from hpctrain.train.training_run import TrainingRun

BASE = {"steps": 20, "global_batch_size": 14, "weight_decay": 0.01, "progress": "off",
        "out_dir": ""}


def run_case(world, overrides: dict) -> dict:
    """Train one configuration; return its summary plus the units it formed."""
    train = {**BASE, **overrides.get("train", {})}
    cfg = load_config(None, [{**overrides, "train": train}])
    trainer = TrainingRun(cfg, world=world)
    summary = trainer.fit()
    par = trainer.par
    units = [(u.name, u.numel) for u in getattr(par, "units", [])]
    report = par.memory_report() if hasattr(par, "memory_report") else None
    return {"losses": summary["losses"], "param_norm": summary["param_norm"],
            "buffer_norm": summary["buffer_norm"], "world_size": summary["world_size"],
            "strategy": summary["strategy"], "units": units, "memory_report": report}


def main(out_path: str, cases_path: str) -> None:
    world = init_world()
    with open(cases_path) as f:
        cases = json.load(f)
    results = {c["id"]: run_case(world, c["overrides"]) for c in cases}
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
