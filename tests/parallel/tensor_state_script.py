"""Under tensor parallel (alone, with zero3, in pipeline stages, in 3D) the whole model's
state assembled from the ranks' slices (``full_state_dict``) is exactly the one-process
model: the qkv weight's whole-head slices, row and column slices and the tied vocabulary
slices go back in their places; and memory_report counts the tp-local bytes. Run by
test_tensor_equivalence's launches (at 2, 4 and 8 ranks)."""

import torch

from hpctrain.config import Config
from hpctrain.models import gpt
from hpctrain.runtime.world import init_world
from hpctrain.train.build import build_model
from hpctrain.train.training_run import TrainingRun

PLANS = {2: [("tensor", "", "")],
         4: [("pipeline", "pp=2,tp=2", ""), ("single", "tp=2,dp=2", "zero3"), ("tensor", "", "")],
         8: [("pipeline", "dp=2,pp=2,tp=2", "fsdp")]}


def main():
    world = init_world()
    want = gpt.factory(0, vocab=68, n_samples=64)[0].state_dict()
    for strategy, mesh, flavour in PLANS[world.size]:
        for sp in (False, True):
            cfg = Config()
            cfg.train.model, cfg.train.strategy = "gpt", strategy
            cfg.train.model_options = {"vocab": 68, "n_samples": 64}
            cfg.train.progress, cfg.train.out_dir, cfg.train.global_batch_size = "off", "", 8
            cfg.runtime.mesh, cfg.runtime.dp_flavour = mesh, flavour
            cfg.tensor.sequence_parallel = sp
            cfg.validate(world.size)
            trainer = TrainingRun(cfg, world=world, built=build_model(cfg, world.size))
            got = trainer.par.full_state_dict()
            where = f"{strategy} {mesh} {flavour} sp={sp} rank {world.rank}"
            assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
            for k, v in want.items():
                assert got[k].shape == v.shape and torch.equal(got[k], v), (where, k)
            assert got["head.weight"] is got["tok_emb.weight"] or torch.equal(
                got["head.weight"], got["tok_emb.weight"]), where


def memory(world):
    """memory_report after an AdamW step at tp = world size: the tp-local parameter,
    gradient and optimizer bytes are 1/tp of the split layers plus the replicated ones."""
    from hpctrain.parallel.tensor import check

    whole = gpt.GPT(vocab=68)
    _, splits, _ = check(whole, None, world.size)
    seen, local = set(), 0
    for key, t in whole.state_dict(keep_vars=True).items():
        if isinstance(t, torch.nn.Parameter) and id(t) not in seen:
            seen.add(id(t))
            local += t.numel() // world.size if key in splits else t.numel()
    cfg = Config()
    cfg.train.model, cfg.train.strategy, cfg.train.steps = "gpt", "tensor", 1
    cfg.train.model_options = {"vocab": 68, "n_samples": 64}
    cfg.train.progress, cfg.train.out_dir, cfg.train.global_batch_size = "off", "", 8
    cfg.validate(world.size)
    trainer = TrainingRun(cfg, world=world, built=build_model(cfg, world.size))
    trainer.fit()
    r = trainer.par.memory_report()
    assert r["tp"] == world.size and r["strategy"] == "tensor", r
    assert r["trainable_numel"] == local and r["params"] == r["grads"] == 4 * local, (local, r)
    # AdamW: exp_avg and exp_avg_sq per element, and a 4-byte step count per flat unit
    assert 8 * local < r["optimizer"] <= 8 * local + 4 * 16, (local, r)


if __name__ == "__main__":
    main()
    if init_world().size in (2, 4):
        memory(init_world())
