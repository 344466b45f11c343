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
from torch.utils.data import DataLoader, Subset

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


def run(case: str, single: bool):
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
