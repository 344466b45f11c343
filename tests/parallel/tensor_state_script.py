"""Under tensor parallel (alone, with zero3, in pipeline stages, in 3D) the whole model's
state assembled from the ranks' slices (``full_state_dict``) is exactly the one-process
model: the qkv weight's whole-head slices, row and column slices and the tied vocabulary
slices go back in their places. Run by test_tensor_equivalence's launches (any world size)."""

import torch

from hpctrain.config import Config
from hpctrain.models import gpt
from hpctrain.runtime.world import init_world
from hpctrain.train.trainer import Trainer, build_model

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
            trainer = Trainer(cfg, world=world, built=build_model(cfg, world.size))
            got = trainer.par.full_state_dict()
            where = f"{strategy} {mesh} {flavour} sp={sp} rank {world.rank}"
            assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
            for k, v in want.items():
                assert got[k].shape == v.shape and torch.equal(got[k], v), (where, k)
            assert got["head.weight"] is got["tok_emb.weight"] or torch.equal(
                got["head.weight"], got["tok_emb.weight"]), where


if __name__ == "__main__":
    main()
