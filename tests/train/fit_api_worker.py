"""hpctrain.Trainer(...).fit(model, DataLoader, loss_fn) under mpirun (tests/train/test_fit_api.py).

``python fit_api_worker.py OUT_JSON STRATEGY [MESH FLAVOUR]``: a user model (dict items, a
custom collate_fn, uneven sizes) trained 12 steps; a callback records every step's metrics
and one run stops itself early; a config error and a model the domain split cannot run
raise the same exception on every rank. Rank 0 writes what it saw.
"""

import csv
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import hpctrain


class Pairs(Dataset):
    """Items are dicts (as many real data sets have); the collate_fn makes (x, y) tensors."""

    def __init__(self, n=96, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 7, generator=g)
        self.y = (self.x @ torch.randn(7, 3, generator=g)).tanh()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i]}


def collate(items):
    return (torch.stack([it["features"] for it in items]),
            torch.stack([it["label"] for it in items]))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.blocks = nn.ModuleList([nn.Linear(7, 13), nn.Linear(13, 13)])
        self.head = nn.Linear(13, 3)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


class Record(hpctrain.Callback):
    def __init__(self, stop_below=None):
        self.steps, self.stop_below, self.ended, self.val = [], stop_below, None, []

    def on_step_end(self, trainer, step, metrics):
        self.steps.append((step, metrics["loss"], metrics["lr"]))
        if self.stop_below is not None and metrics["loss"] < self.stop_below:
            trainer.should_stop = True

    def on_validation_end(self, trainer, step, metrics):
        self.val.append((step, metrics["val_loss"]))

    def on_fit_end(self, trainer, summary):
        self.ended = summary["steps"]


def main():
    out, strategy = sys.argv[1], sys.argv[2]
    mesh = dict(mesh=sys.argv[3], dp_flavour=sys.argv[4]) if len(sys.argv) > 4 else {}
    torch.set_num_threads(1)
    loader = DataLoader(Pairs(), batch_size=16, shuffle=True, collate_fn=collate)
    loss = nn.functional.mse_loss
    rec = Record()
    # 37 validation samples in batches of 10: the last batch is short and some ranks'
    # parts of it are empty
    val = DataLoader(Pairs(37, seed=5), batch_size=10, collate_fn=collate)
    # metrics.csv (rank 0 writes it): the validations and the global gradient norms per step
    run_dir = f"{out}.run"
    trainer = hpctrain.Trainer(strategy=strategy, steps=12, lr=0.05, optimizer="sgd",
                               progress="off", out_dir=run_dir,
                               set={"train.report": False, "train.tensorboard": False},
                               callbacks=[rec], val_every=4, **mesh)
    summary = trainer.fit(Net(), loader, val, loss_fn=loss)
    after = trainer.validate(val)["val_loss"]
    # early stopping: every rank stops after the same step
    early = Record(stop_below=summary["losses"][4])
    again = hpctrain.Trainer(strategy=strategy, epochs=4, lr=0.05, optimizer="sgd",
                             progress="off", out_dir="", callbacks=[early], **mesh)
    cut = again.fit(Net(), loader, loss_fn=loss)
    stopped = trainer.world.mpi_comm.allgather(cut["steps"])
    # what the plan cannot run: the same clear exception on every rank, before any step
    refused = []
    for options in (dict(strategy=strategy, steps=4, set={"train.lr_schedule": "warmup_cosine",
                                                          "train.warmup_steps": 10}, **mesh),
                    dict(strategy="domain", steps=2)):
        try:
            hpctrain.Trainer(progress="off", out_dir="", **options).fit(Net(), loader,
                                                                         loss_fn=loss)
            refused.append(None)
        except ValueError as exc:
            refused.append([type(exc).__name__, str(exc)])
    refused = trainer.world.mpi_comm.allgather(refused)
    if trainer.world.rank == 0:
        with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
            rows = [[int(r["step"]), r["grad_norm"], r["val_loss"]] for r in csv.DictReader(f)]
        with open(out, "w") as f:
            json.dump({"losses": summary["losses"], "steps_seen": rec.steps, "ended": rec.ended,
                       "val": rec.val, "val_summary": summary["val_losses"], "after": after,
                       "early_losses": cut["losses"], "stopped_at": stopped,
                       "early_ended": early.ended, "refused": refused, "csv": rows}, f)


if __name__ == "__main__":
    from hpctrain.runtime.abort import abort_on_exception

    sys.exit(abort_on_exception(main))
