"""User-shaped models (ResNet, ViT, GPT as a Sequential) and the Python API, many cases in
ONE process (under mpirun or alone). Rank 0 writes {case id: record}.

``python user_models_worker.py OUT.json CASES.json``; each case has an "id" and a "kind":

- "train": ``overrides`` (config tables) for the Trainer -> losses, param_norm and, with
  "state", the whole final state from ``par.full_state_dict()``; the sharded units.
- "api": ``hpctrain.parallelize(model, ..., strategy)`` on a fixture model, trained a few
  steps with this rank's share of each batch next to a one-process reference trained on the
  whole batch IN THIS PROCESS -> how far ``full_state_dict``/``param_norm`` are from the
  reference, which of the job communicator's collectives the norms and ``full_state_dict``
  ran, what ``model.state_dict()`` does, the ZeRO stage run.
- "refuse": ``parallelize`` that must raise -> the exception's class and message.
"""

import copy
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import hpctrain
from hpctrain.config import load_config
from hpctrain.data.sampler import collate
from hpctrain.parallel.zero import ZeroOptions
from hpctrain.runtime.world import init_world
from hpctrain.train.precision import Precision
from hpctrain.train.training_run import TrainingRun
from tests.fixtures import awkward, tied_seq

BASE = {"steps": 20, "global_batch_size": 16, "progress": "off", "out_dir": ""}
API_STEPS, API_BATCH = 3, 16
COLLECTIVES = {"allreduce", "allreduce_scalars", "allgather", "broadcast", "barrier",
               "reduce_scatter"}


def _conv_factory():
    """A periodic conv net on 8x8 fields, for the domain strategy."""
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                          nn.Conv2d(4, 1, 3, padding=1, padding_mode="circular"))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 1, 8, 8, generator=g)
    return model, TensorDataset(x, torch.roll(x, 1, dims=-1) * 0.5), F.mse_loss


MODELS = {"awkward": awkward.factory, "awkward_bn": awkward.factory_batchnorm,
          "tied_seq": tied_seq.factory, "conv": _conv_factory}


def train_case(world, case: dict) -> dict:
    overrides = case["overrides"]
    cfg = load_config(None, [{**overrides, "train": {**BASE, **overrides.get("train", {})}}])
    trainer = TrainingRun(cfg, world=world)
    summary = trainer.fit()
    par = trainer.par
    rec = {"losses": summary["losses"], "param_norm": summary["param_norm"],
           "units": [(u.name, u.numel) for u in getattr(par, "units", [])]}
    if case.get("state"):
        rec["state"] = {k: v.double().reshape(-1).tolist() for k, v in par.full_state_dict().items()}
    return rec


class _Counting:
    """A communicator that counts the collectives called on it."""

    def __init__(self, comm):
        self._comm, self.calls = comm, 0

    def __getattr__(self, name):
        if name in COLLECTIVES:
            self.calls += 1
        return getattr(self._comm, name)


def _collectives(par, method) -> int:
    """How many collectives ``method`` ran on the job communicator."""
    counting = _Counting(par.job_comm)
    par.job_comm = counting
    try:
        method()
    finally:
        par.job_comm = counting._comm
    return counting.calls


def _norm(params) -> float:
    unique = {id(p): p for p in params}.values()
    return math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in unique))


def api_case(world, case: dict) -> dict:
    torch.manual_seed(0)  # the same user model on every rank (parallelize broadcasts anyway)
    model, data, loss_fn = MODELS[case["model"]]()
    reference = copy.deepcopy(model)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, weight_decay=0.01)  # noqa: E731
    options = ZeroOptions(**case["zero"]) if "zero" in case else None
    par = hpctrain.parallelize(model, make, strategy=case["strategy"], world=world,
                               options=options)
    ref_opt, precision = make(reference.parameters()), Precision("fp32", world.device)
    for step in range(API_STEPS):
        batch = list(range(step * API_BATCH, (step + 1) * API_BATCH))
        x, y = collate(data, batch)
        loss_fn(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        r, n = par.data_shard(world)
        mine = batch[r * API_BATCH // n:(r + 1) * API_BATCH // n]
        x, y = par.load_batch(data, mine)
        par.forward_backward([(x, y, len(mine) / API_BATCH)], loss_fn, precision)
        par.step()
    ref = reference.state_dict()
    full = par.full_state_dict()
    mine0 = par.full_state_dict(rank0_only=True)
    holders = world.host.allreduce_scalars([1.0 if mine0 else 0.0])[0]
    try:
        par.model.state_dict()
        state_dict = "ok"
    except RuntimeError as exc:
        state_dict = f"RuntimeError: {exc}"
    return {
        "keys": list(full) == list(ref),
        "max_rel_err": max(float((full[k].double() - v.double()).abs().max()
                                 / max(float(v.double().abs().max()), 1e-12))
                           for k, v in ref.items() if k in full and v.numel()),
        "int_buffers_equal": all(torch.equal(full[k], v) for k, v in ref.items()
                                 if k in full and not v.is_floating_point()),
        "tied_shared": all(full[a] is full[b] for a, b in case.get("tied", [])),
        "rank0_only_holders": holders,
        "param_norm_rel_err": abs(par.param_norm() / _norm(reference.parameters()) - 1),
        "collectives": {name: _collectives(par, getattr(par, name))
                        for name in ("param_norm", "buffer_norm", "full_state_dict")},
        "state_dict": state_dict,
        "stage": par.memory_report().get("stage") if hasattr(par, "memory_report") else None,
    }


def refuse_case(world, case: dict) -> dict:
    model, _, _ = MODELS[case["model"]]()
    try:
        hpctrain.parallelize(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                             strategy=case["strategy"], world=world)
    except (ValueError, TypeError) as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


KINDS = {"train": train_case, "api": api_case, "refuse": refuse_case}


def main(out_path: str, cases_path: str) -> None:
    world = init_world()
    with open(cases_path) as f:
        cases = json.load(f)
    results = {}
    for c in cases:
        results[c["id"]] = KINDS[c["kind"]](world, c)
        world.host.barrier()
    if world.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
