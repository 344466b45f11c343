"""Run many training configurations in ONE MPI job (amortises start-up) and print JSON.

usage: python -m tests.parallel.pipeline_worker CASES_JSON OUT_JSON
CASES_JSON: list of {"name":..., "train": {...}, "pipeline": {...}, "runtime": {...},
"checkpoint": {...}}; rank 0 writes {name: summary} to OUT_JSON.
"""

import json
import sys

from hpctrain.config import Config
from hpctrain.runtime.world import init_world
from hpctrain.train.build import build_model
from hpctrain.train.training_run import TrainingRun


def make_config(case: dict) -> Config:
    cfg = Config()
    cfg.train.progress, cfg.train.out_dir, cfg.train.log_every = "off", "", 1000
    for section in ("train", "pipeline", "runtime", "checkpoint", "fsdp"):
        for k, v in case.get(section, {}).items():
            setattr(getattr(cfg, section), k, v)
    return cfg


def run_cases(instrument=None) -> None:
    """Train every case of CASES_JSON; rank 0 writes {name: summary} to OUT_JSON.
    ``instrument(case, trainer, world)`` (optional) runs before fit() and returns None or a
    function that adds fields to the case's record afterwards."""
    cases = json.loads(open(sys.argv[1]).read())
    world = init_world()
    out = {}
    for case in cases:
        cfg = make_config(case)
        cfg.validate(world.size)
        trainer = TrainingRun(cfg, world=world, built=build_model(cfg, world.size))
        finish = instrument(case, trainer, world) if instrument else None
        s = trainer.fit()
        rec = {k: s[k] for k in ("losses", "param_norm", "buffer_norm", "world_size",
                                 "strategy")}
        if finish is not None:
            finish(rec)
        out[case["name"]] = rec
        world.host.barrier()
    if world.rank == 0:
        with open(sys.argv[2], "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    run_cases()
