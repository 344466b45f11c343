"""Any torch DataLoader through hpctrain.Trainer.fit (tests/train/test_fit_data.py).

``python fit_data_worker.py OUT_JSON CASE [CASE ...]``: each CASE (see CASES) trains a tiny
model through a DataLoader and validates; ``single:<case>`` runs it under one process (the
map-style cases without workers: what they must equal). Rank 0 writes {case: [losses, val
losses...]}.
"""

import json
import os
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, get_worker_info

import hpctrain
from tests.train.fit_api_worker import collate  # dict items -> (x, y)

FORK = dict(multiprocessing_context="fork")  # a cheap start for the tests' workers


def _pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 7, generator=g)
    return x, (x @ torch.randn(7, 3, generator=g)).tanh()


class Pairs(Dataset):
    """Map-style, dict items (the collate_fn makes (x, y))."""

    def __init__(self, n, seed):
        self.x, self.y = _pairs(n, seed)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": self.y[i]}


class Stream(IterableDataset):
    """Dict items; with workers, worker w of k yields samples w, w + k, ... (each once)."""

    def __init__(self, n, seed):
        self.x, self.y = _pairs(n, seed)

    def __len__(self):  # for epochs=
        return len(self.x)

    def __iter__(self):
        info = get_worker_info()
        first, every = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, len(self.x), every):
            yield {"features": self.x[i], "label": self.y[i]}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.body = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 13), nn.Tanh(),
                                  nn.Linear(13, 3))

    def forward(self, x):
        return self.body(x)


class ConvNet(nn.Module):
    """A small convolutional model for the domain split (halos across the tiles)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GELU(),
                                  nn.Conv2d(4, 1, 3, padding=1))

    def forward(self, x):
        return self.body(x)


def fields(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 12, 10, generator=g)
    return TensorDataset(x, nn.functional.avg_pool2d(x.sum(1, keepdim=True), 3, 1, 1))


class StopAfter(hpctrain.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        trainer.should_stop = step >= self.step


def _fit(model, train, val, strategy, trained=None, **more):
    """The losses, the validation losses during fit and validate()'s after."""
    trainer = hpctrain.Trainer(strategy=strategy, lr=0.05, optimizer="sgd", progress="off",
                               out_dir="", **more)
    summary = trainer.fit(model, train, val, loss_fn=nn.functional.mse_loss)
    if trained is not None:  # a resumed run trains only the steps after its checkpoint
        assert summary["trained_steps"] == trained, summary["trained_steps"]
    return summary["losses"] + [v for _, v in summary["val_losses"]] + \
        [trainer.validate(val)["val_loss"]]


def map_workers(single, out_dir):
    """Map-style, a collate_fn, 2 workers (1 under one process: none), zero3, grad_accum 2."""
    workers = {} if single else dict(num_workers=2, persistent_workers=True, **FORK)
    train = DataLoader(Pairs(64, 3), batch_size=16, shuffle=True, collate_fn=collate,
                       **workers)
    val = DataLoader(Pairs(37, 5), batch_size=10, collate_fn=collate, **workers)
    return _fit(Net(), train, val, "single" if single else "zero3", steps=6, val_every=3,
                grad_accum=2)


def stream(single, out_dir):
    """A stream of 40 in batches of 8 without workers: epochs=2 are 10 steps, two passes."""
    train = DataLoader(Stream(40, 3), batch_size=8, collate_fn=collate)
    val = DataLoader(Stream(23, 5), batch_size=6, collate_fn=collate)
    return _fit(Net(), train, val, "single" if single else "ddp", epochs=2, val_every=5)


def stream_workers(single, out_dir):
    """The stream in 2 workers: 8, 8, 4 rows each per pass, the 4s dropped, so steps 5-7 are
    a second pass; at 2 ranks trained to step 3 (a checkpoint), then resumed to 7."""
    def loader(n, seed, batch):
        return DataLoader(Stream(n, seed), batch_size=batch, collate_fn=collate,
                          num_workers=2, **FORK)

    train, val = loader(40, 3, 8), loader(23, 5, 6)
    if single:
        return _fit(Net(), train, val, "single", steps=7)
    ckpt = os.path.join(out_dir, "ckpt-stream")
    _fit(Net(), train, val, "zero3", steps=7, checkpoint_dir=ckpt, checkpoint_every=3,
         callbacks=[StopAfter(3)])
    return _fit(Net(), train, val, "zero3", trained=4, steps=7, checkpoint_dir=ckpt,
                resume="auto")


def domain_workers(single, out_dir):
    """The domain split (each rank keeps its tile of what the workers read) over dom=2."""
    workers = dict(num_workers=2, **FORK)
    train = DataLoader(fields(24, 8), batch_size=8, **workers)
    val = DataLoader(fields(11, 9), batch_size=6, **workers)  # a short last batch
    options = dict(strategy="single") if single else dict(mesh="dom=2", dp_flavour="ddp")
    trainer = hpctrain.Trainer(steps=3, lr=0.05, optimizer="sgd", progress="off", out_dir="",
                               **options)
    summary = trainer.fit(ConvNet(), train, val, loss_fn=nn.functional.mse_loss)
    return summary["losses"] + [v for _, v in summary["val_losses"]]


CASES = {"map-workers": map_workers, "stream": stream, "stream-workers": stream_workers,
         "domain-workers": domain_workers}


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "This DataLoader will create")  # 2 workers, 1 core
    result = {}
    for case in cases:
        single = case.startswith("single:")
        result[case] = CASES[case.removeprefix("single:")](single, os.path.dirname(out))
    if hpctrain.init().rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hpctrain.runtime.abort import abort_on_exception

    sys.exit(abort_on_exception(main))
