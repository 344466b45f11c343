"""Hugging Face models through hpctrain.Trainer.fit under mpirun (tests/train/test_fit_hf.py).

``python fit_hf_worker.py OUT_JSON CASE [CASE ...]``, a CASE being ``STRATEGY:MODEL`` or
``STRATEGY:MODEL:resume:CKPT_DIR``. MODEL is gpt2, llama (tiny, random init, logits out:
tests/fixtures/hf_models.py) or gpt2-output: the plain GPT2LMHeadModel, whose forward
returns a ModelOutput, with a loss reading ``output.logits`` (the same loss under every
plan, the pipeline's last stage included). Each trains 16 steps through a torch DataLoader
with AdamW and a warm-up + cosine schedule, then validates. With resume: the same 16 steps
in two fits, the first stopped after step 7 (a callback, as a job's time limit would) with
its checkpoint, then a resumed fit to 16 (mid-epoch: 256 samples in batches of 16 make 16
steps an epoch; the cosine runs to step 16 in both). Rank 0 writes {case: result}.
"""

import json
import sys

import torch
from torch.utils.data import DataLoader

import hpctrain
from hpctrain.models.gpt import lm_loss
from tests.fixtures import hf_models

SCHEDULE = {"train.lr_schedule": "warmup_cosine", "train.warmup_steps": 4}


def gpt2_output_factory():
    """The plain HF GPT-2 (forward -> CausalLMOutput) and a loss on its ``.logits``."""
    from transformers import GPT2LMHeadModel

    model = hf_models.gpt2_model()
    plain = GPT2LMHeadModel(model.config)
    plain.load_state_dict(model.state_dict())
    return plain, hf_models._tokens(), lambda out, y: lm_loss(out.logits, y)


MODELS = {"gpt2": hf_models.gpt2_factory, "llama": hf_models.llama_factory,
          "gpt2-output": gpt2_output_factory, "llama-tp": hf_models.llama_tp_factory}


class StopAfter(hpctrain.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        trainer.should_stop = step >= self.step


def _trainer(strategy, steps, **more):
    return hpctrain.Trainer(strategy=strategy, steps=steps, lr=3e-3, optimizer="adamw",
                            progress="off", out_dir="", set=dict(SCHEDULE), **more)


def run(case: str) -> dict:
    strategy, which, *resume = case.split(":", 3)
    make = MODELS[which]
    model, data, loss = make()
    loader = DataLoader(data, batch_size=16, shuffle=True)
    if not resume:
        trainer = _trainer(strategy, 16)
        summary = trainer.fit(model, loader, loss_fn=loss)
        # batches of 24: the last one (16) pads the pipeline's last piece
        val = trainer.validate(DataLoader(data, batch_size=24))["val_loss"]
        return {"losses": summary["losses"], "val": val}
    ckpt = resume[1]
    first = _trainer(strategy, 16, checkpoint_dir=ckpt, checkpoint_every=7,
                     callbacks=[StopAfter(7)])
    first.fit(model, loader, loss_fn=loss)
    model, _, _ = make()  # a fresh process would build it again: the checkpoint wins
    second = _trainer(strategy, 16, checkpoint_dir=ckpt, resume="auto")
    return {"losses": second.fit(model, loader, loss_fn=loss)["losses"]}


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    result = {case: run(case) for case in cases}
    if hpctrain.init().rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from hpctrain.runtime.abort import abort_on_exception

    sys.exit(abort_on_exception(main))
