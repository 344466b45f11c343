"""Hugging Face models through hpctrain.Trainer.fit under mpirun (tests/train/test_fit_hf.py).

``python fit_hf_worker.py OUT_JSON STRATEGY MODEL [CKPT_DIR]``: MODEL is gpt2 or llama (tiny,
random init, tests/fixtures/hf_models.py), trained through a torch DataLoader with AdamW and
a warm-up + cosine schedule, validated at the end. With CKPT_DIR: the same 16 steps in two
fits, the first stopped after step 7 (a callback, as a job's time limit would) with its
checkpoint, then a resumed fit to 16 (mid-epoch: 256 samples in batches of 16 make 16 steps
an epoch; the cosine runs to step 16 in both). Rank 0 writes the losses.
"""

import json
import sys

import torch
from torch.utils.data import DataLoader

import hpctrain
from tests.fixtures import hf_models

SCHEDULE = {"train.lr_schedule": "warmup_cosine", "train.warmup_steps": 4}


class StopAfter(hpctrain.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        trainer.should_stop = step >= self.step


def _trainer(strategy, steps, **more):
    return hpctrain.Trainer(strategy=strategy, steps=steps, lr=3e-3, optimizer="adamw",
                            progress="off", out_dir="", set=dict(SCHEDULE), **more)


def main():
    out, strategy, which = sys.argv[1], sys.argv[2], sys.argv[3]
    ckpt = sys.argv[4] if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    make = {"gpt2": hf_models.gpt2_factory, "llama": hf_models.llama_factory}[which]
    model, data, loss = make()
    loader = DataLoader(data, batch_size=16, shuffle=True)
    if ckpt is None:
        trainer = _trainer(strategy, 16)
        summary = trainer.fit(model, loader, loss_fn=loss)
        # batches of 24: the last one (16) pads the pipeline's last piece
        val = trainer.validate(DataLoader(data, batch_size=24))["val_loss"]
        result = {"losses": summary["losses"], "val": val}
    else:
        first = _trainer(strategy, 16, checkpoint_dir=ckpt, checkpoint_every=7,
                         callbacks=[StopAfter(7)])
        first.fit(model, loader, loss_fn=loss)
        model, _, _ = make()  # a fresh process would build it again: the checkpoint wins
        second = _trainer(strategy, 16, checkpoint_dir=ckpt, resume="auto")
        result = {"losses": second.fit(model, loader, loss_fn=loss)["losses"]}
    if hpctrain.init().rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hpctrain.runtime.abort import abort_on_exception

    sys.exit(abort_on_exception(main))
