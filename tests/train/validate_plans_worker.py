"""Validation under every plan family (tests/train/test_validate_plans.py).

``python validate_plans_worker.py OUT_JSON CASE [CASE ...]``: each CASE names a plan (see
PLANS); its model trains 3 steps, then ``validate()`` runs over a held-out set whose last
batch is short (so some ranks' parts, and some pipeline pieces, are partly or wholly empty).
``single:<case>`` runs that case's model under one process. Rank 0 writes {case: [losses,
validation loss]}.
"""

import json
import sys

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

import hpctrain

GPT = {"train.model": "gpt", "train.model_options": {"d_model": 32, "heads": 4, "layers": 4,
                                                     "vocab": 68,
                                                     "seq_len": 16}}
UNET = {"train.model": "unet"}

# case -> (keyword options, config settings)
PLANS = {
    "pipeline-zero3": (dict(mesh="pp=2,dp=2", dp_flavour="zero3"),
                       {**GPT, "pipeline.microbatches": 2}),
    "pipeline-interleaved": (dict(strategy="pipeline"),
                             {**GPT, "pipeline.microbatches": 2,
                              "pipeline.schedule": "interleaved-1f1b",
                              "pipeline.virtual_stages": 2}),
    "tensor-dp": (dict(mesh="tp=2,dp=2", dp_flavour="zero1"),
                  {**GPT, "tensor.sequence_parallel": True}),
    "domain-dp": (dict(mesh="dom=2,dp=2", dp_flavour="zero3"), UNET),
    "fsdp": (dict(strategy="fsdp"), GPT),
}


class ConvNet(torch.nn.Module):
    """A user's convolutional model (not a built-in): domain-parallel through fit()."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = torch.nn.Sequential(torch.nn.Conv2d(2, 6, 3, padding=1), torch.nn.GELU(),
                                        torch.nn.GroupNorm(2, 6), torch.nn.Conv2d(6, 6, 5, padding=2),
                                        torch.nn.GELU(), torch.nn.Conv2d(6, 1, 3, padding=1))

    def forward(self, x):
        return self.body(x)


def fields(n: int, seed: int):
    """(input fields, target fields) on a 12 x 10 grid: the target smooths the inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 12, 10, generator=g)
    y = torch.nn.functional.avg_pool2d(x.sum(1, keepdim=True), 3, 1, 1)
    return TensorDataset(x, y)


def fit_user_conv(options: dict):
    """Trainer.fit(user model, DataLoader, val DataLoader) under the domain split: the
    validation every 2 steps and validate() after."""
    trainer = hpctrain.Trainer(steps=4, lr=0.05, optimizer="sgd", progress="off", out_dir="",
                               **options)
    val = DataLoader(fields(23, 9), batch_size=6)  # a short last batch
    trainer.val_every = 2
    summary = trainer.fit(ConvNet(), DataLoader(fields(48, 8), batch_size=8), val,
                          loss_fn=torch.nn.functional.mse_loss)
    return summary["losses"] + [v for _, v in summary["val_losses"]], \
        trainer.validate(val)["val_loss"]


def run(case: str, single: bool):
    if case == "domain-fit":
        return fit_user_conv(dict(strategy="single") if single else
                             dict(mesh="dom=2,dp=2", dp_flavour="ddp"))
    options, settings = PLANS[case]
    if single:  # the same model and data; the plan's own tables do not apply
        options = dict(strategy="single")
        settings = {k: v for k, v in settings.items() if k.startswith("train.")}
    trainer = hpctrain.Trainer(steps=3, lr=0.05, optimizer="sgd", progress="off", out_dir="",
                               global_batch_size=8, set=dict(settings), **options)
    summary = trainer.fit()
    data = trainer.engine.built.dataset
    val = DataLoader(Subset(data, range(len(data) - 37, len(data))), batch_size=10)
    return summary["losses"], trainer.validate(val)["val_loss"]


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    result = {}
    for case in cases:
        single = case.startswith("single:")
        result[case] = run(case.removeprefix("single:"), single)
    if hpctrain.init().rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hpctrain.runtime.abort import abort_on_exception

    sys.exit(abort_on_exception(main))
