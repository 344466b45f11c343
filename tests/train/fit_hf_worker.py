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


class Padded(torch.utils.data.Dataset):
    """Markov token sequences cut to random lengths and right-padded: items are
    ({"input_ids", "attention_mask"}, labels with -100 at the padding), as a tokenizer and
    a Hugging Face collator give them. Samples hold 4 to 16 tokens, so a mean over tokens
    is not a mean over samples (train.loss_weight = tokens)."""

    def __init__(self, vocab):
        from hpctrain.data.synthetic import make_markov_tokens

        self.tokens = make_markov_tokens(hf_models.SAMPLES, hf_models.SEQ_LEN, vocab, 0, 3)
        g = torch.Generator().manual_seed(4)
        self.lengths = torch.randint(4, hf_models.SEQ_LEN + 1, (len(self.tokens),), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        x, y = self.tokens[i]
        real = torch.arange(len(x)) < self.lengths[i]
        return ({"input_ids": x.masked_fill(~real, 0), "attention_mask": real.long()},
                y.masked_fill(~real, -100))


class PaddedIds(Padded):
    """Padded's samples with the input_ids tensor alone (a causal model needs no mask for
    right padding): what the pipeline, which passes one tensor between stages, takes."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x["input_ids"], y


def padded_ids_factory():
    model, _, loss = hf_models.gpt2_factory()
    return model, PaddedIds(model.config.vocab_size), loss


def padded_factory(kind):
    """A plain HF model called with keywords (input_ids, attention_mask), its ModelOutput's
    logits against labels with padding ignored."""
    def make():
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

        model = hf_models.gpt2_model() if kind == "gpt2" else hf_models.llama_model(vocab=98)
        plain = (GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM)(model.config)
        plain.load_state_dict(model.state_dict())
        data = Padded(model.config.vocab_size)

        def loss(out, y):
            return lm_loss(out.logits, y)
        loss.cross_entropy = True  # tensor parallel may run it on vocabulary-parallel logits
        return plain, data, loss
    return make


MODELS = {"gpt2": hf_models.gpt2_factory, "llama": hf_models.llama_factory,
          "gpt2-output": gpt2_output_factory, "llama-tp": hf_models.llama_tp_factory,
          "gpt2-padded": padded_factory("gpt2"), "llama-padded": padded_factory("llama"),
          "gpt2-padded-by-samples": padded_factory("gpt2"), "gpt2-padded-ids": padded_ids_factory}


class StopAfter(hpctrain.Callback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        trainer.should_stop = step >= self.step


def _trainer(strategy, steps, tokens=False, **more):
    return hpctrain.Trainer(strategy=strategy, steps=steps, lr=3e-3, optimizer="adamw",
                            progress="off", out_dir="", set=dict(SCHEDULE),
                            loss_weight="tokens" if tokens else "samples", **more)


def run(case: str) -> dict:
    strategy, which, *resume = case.split(":", 3)
    make = MODELS[which]
    model, data, loss = make()
    loader = DataLoader(data, batch_size=16, shuffle=True)
    if not resume:
        trainer = _trainer(strategy, 16, tokens="padded" in which and "by-samples" not in which)
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
