"""Train user models that are not Sequential (HF GPT-2 / Llama, a generic chain) in ONE
process (under mpirun or alone). Rank 0 writes {case id: {"losses", "param_norm", "log"}}.

``python pipeline_any_worker.py OUT.json CASES.json``; each case is {"id", "overrides"}
(config tables for the Trainer, train.steps etc. defaulting to BASE).
"""

import contextlib
import io
import json
import sys

from hpctrain.config import load_config
from hpctrain.runtime.world import init_world
from hpctrain.train.trainer import Trainer

BASE = {"steps": 20, "global_batch_size": 16, "progress": "off", "out_dir": "",
        "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.01}


def train_case(world, case: dict) -> dict:
    overrides = case["overrides"]
    cfg = load_config(None, [{**overrides, "train": {**BASE, **overrides.get("train", {})}}])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the pipeline's split line, for the tests
        summary = Trainer(cfg, world=world).fit()
    return {"losses": summary["losses"], "param_norm": summary["param_norm"],
            "log": log.getvalue()}


def main(out_path: str, cases_path: str) -> None:
    world = init_world()
    with open(cases_path) as f:
        cases = json.load(f)
    results = {case["id"]: train_case(world, case) for case in cases}
    if world.is_main:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
