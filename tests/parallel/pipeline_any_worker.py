"""Train user models that are not Sequential (HF GPT-2 / Llama, a generic chain) in ONE
process (under mpirun or alone). Rank 0 writes {case id: {"losses", "param_norm", "log"}}.

``python pipeline_any_worker.py OUT.json CASES.json``; each case is {"id", "overrides"}
(config tables for the Trainer, train.steps etc. defaulting to BASE), or {"id", "fit",
"kwargs"} (a fixture function training through hpctrain.Trainer.fit); with "refused":
true, {"error": the UsageError's text} instead.
"""

import contextlib
import importlib
import io
import json
import sys

from hpctrain.config import load_config
from hpctrain.errors import UsageError
from hpctrain.runtime.world import init_world
from hpctrain.train.training_run import TrainingRun

BASE = {"steps": 20, "global_batch_size": 16, "progress": "off", "out_dir": "",
        "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.01}


def fit_case(world, case: dict) -> dict:
    """A case through hpctrain.Trainer.fit: {"fit": "module:function", "kwargs": {...}}; the
    function takes the world and returns fit's summary."""
    module, _, name = case["fit"].partition(":")
    fit = getattr(importlib.import_module(module), name)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        summary = fit(world, **case.get("kwargs", {}))
    return {"losses": summary["losses"], "param_norm": summary["param_norm"],
            "val": [v for _, v in summary.get("val_losses", [])], "log": log.getvalue()}


def train_case(world, case: dict) -> dict:
    if case.get("refused"):  # every rank raises the same one-line error, before training
        try:
            _train(world, case)
        except UsageError as exc:
            return {"error": str(exc)}
        return {"error": None}
    return _train(world, case)


def _train(world, case: dict) -> dict:
    if "fit" in case:
        return fit_case(world, case)
    overrides = case["overrides"]
    cfg = load_config(None, [{**overrides, "train": {**BASE, **overrides.get("train", {})}}])
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the pipeline's split line, for the tests
        summary = TrainingRun(cfg, world=world).fit()
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
