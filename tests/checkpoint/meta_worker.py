"""Worker for test_meta: damaged-metadata variants of one checkpoint, each inspected and resumed.

    python -m tests.checkpoint.meta_worker SRC WORKDIR
Prints one JSON line per variant: how `ckpt inspect` and `--resume PATH` took it.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import sys

import h5py
import numpy as np

from hpctrain.checkpoint import CheckpointError
from hpctrain.checkpoint.meta import META_CRC, seal
from hpctrain.checkpoint.tools import inspect
from hpctrain.config import load_config
from hpctrain.models import gpt
from hpctrain.train.training_run import TrainingRun
from tests.checkpoint.forge import FORGERIES


def _lr(f):
    groups = f.attrs["optim_param_groups"]
    assert '"lr": 0.003' in groups, groups
    f.attrs["optim_param_groups"] = groups.replace('"lr": 0.003', '"lr": 0.007')


def _resealed(change):
    def run(f):
        change(f)
        seal(f)  # the checksum matches: the attribute checks must catch it
    return run


def _set(key, value):
    return lambda f: f.attrs.__setitem__(key, value)


def _dtype(f):
    f["model/tok_emb.weight"].attrs["torch_dtype"] = "float33"


def _json(key, edit):
    """Edit the parsed JSON of attribute key in place (hand-editing a checkpoint)."""
    def run(f):
        value = json.loads(f.attrs[key])
        edit(value)
        f.attrs[key] = json.dumps(value)
    return run


def _rng_floats(f):
    attrs, rows = dict(f["rng/torch_cpu"].attrs), f["rng/torch_cpu"][()]
    del f["rng/torch_cpu"]
    f.create_dataset("rng/torch_cpu", data=rows.astype(np.float32)).attrs.update(
        {**attrs, "torch_dtype": "float32"})


def _forged(name):
    return lambda f: FORGERIES[name][0](f, os.path.dirname(f.filename))


VARIANTS = {
    "ok": lambda f: None,
    "lr_flipped": _lr,
    "step_flipped": _set("step", np.int64(1)),
    "step_flipped_unsealed": lambda f: (_set("step", np.int64(1))(f),
                                        f.attrs.__delitem__(META_CRC)),
    "sampler_bad_json": _resealed(_set("sampler_state", '{"step": 2')),
    "grad_scaler_missing": _resealed(lambda f: f.attrs.__delitem__("grad_scaler")),
    "groups_not_list": _resealed(_set("optim_param_groups", '{"lr": 0.003}')),
    "torch_dtype_unknown": _resealed(_dtype),
    # Wrong-typed values that once passed inspect and crashed the resumed run's first step.
    "lr_string": _resealed(_json("optim_param_groups", lambda g: g[0].update(lr="0.003"))),
    "betas_short": _resealed(_json("optim_param_groups", lambda g: g[0].update(betas=[0.9]))),
    "sampler_step_string": _resealed(_json("sampler_state", lambda s: s.update(step="2"))),
    "schedule_epoch_string": _resealed(_json("lr_schedule",
                                             lambda s: s["state"].update(last_epoch="1"))),
    "world_size_string": _resealed(_set("world_size", "1")),
    "rng_floats": _resealed(_rng_floats),
    # Files that point elsewhere or claim what they cannot hold (forge.py), by --resume PATH.
    "absurd_shape": _resealed(_forged("absurd_shape")),
    "virtual_elsewhere": _resealed(_forged("virtual_elsewhere")),
    "unsealed": lambda f: f.attrs.__delitem__(META_CRC),
}


def _resume(path: str) -> dict:
    cfg = load_config(None, [{"train": {"model": "gpt", "strategy": "single", "steps": 2,
                                        "optimizer": "adamw", "lr": 0.003,
                                        "global_batch_size": 8, "progress": "off",
                                        "out_dir": ""}},
                             {"checkpoint": {"dir": os.path.dirname(path), "resume": path}}])
    try:
        t = TrainingRun(cfg)
    except CheckpointError as exc:
        return {"resume_error": str(exc)}
    return {"step": t.start_step, "lr": t.par.optimizer.param_groups[0]["lr"]}


def main() -> int:
    src, work = sys.argv[1], sys.argv[2]
    # Every variant's Trainer builds the same GPT data (most of its time): build it once.
    gpt.make_markov_tokens = functools.lru_cache(gpt.make_markov_tokens)
    for name, change in VARIANTS.items():
        path = os.path.join(work, name, "ckpt-000002.h5")
        os.makedirs(os.path.dirname(path))
        shutil.copy(src, path)
        with h5py.File(path, "r+") as f:
            change(f)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = inspect(path, out=io.StringIO())
            out = {"variant": name, "inspect_rc": rc, **_resume(path)}
        print(json.dumps({**out, "stderr": err.getvalue()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
