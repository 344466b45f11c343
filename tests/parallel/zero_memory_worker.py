"""Under mpirun: ZeRO's per-rank memory after a step matches the paper's fp32-Adam formulas,
and the full gradients (stage 2) and full parameters (stage 3) really are freed."""

import sys

import torch

from hpctrain.models.gpt import GPT, lm_loss
from hpctrain.parallel.zero import ZeroOptions, wrap
from hpctrain.runtime.world import init_world
from tests.parallel.memory_check import check_report

world = init_world()
N = world.size


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def formula(stage, psi):
    """(params, grads, optimizer) bytes per rank, fp32 Adam (Rajbhandari et al. 2020)."""
    return {1: (4 * psi, 4 * psi, 8 * psi / N),
            2: (4 * psi, 4 * psi / N, 8 * psi / N),
            3: (4 * psi / N, 4 * psi / N, 8 * psi / N)}[stage]


torch.manual_seed(0)
tokens = torch.randint(0, 67, (4, 33))
x, y = tokens[:, :-1], tokens[:, 1:]
for stage in (1, 2, 3):
    torch.manual_seed(0)
    model = GPT(vocab=67, d_model=48, heads=4, layers=4, seq_len=32)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied counted once
    par = wrap(model, make_opt, world, ZeroOptions(stage=stage))
    out = par.model(x)
    if stage == 3:  # after forward every unit's full buffer is released
        held = [u.full.untyped_storage().nbytes() for u in par.units]
        assert held == [0] * len(held), f"stage 3 kept gathered units after forward: {held}"
    par.backward(lm_loss(out, y) / N)
    if stage >= 2:  # every parameter was used: its full gradient was freed during backward
        left = [n for n, p in model.named_parameters() if p.grad is not None]
        assert not left, f"stage {stage} kept full gradients after backward: {left}"
    par.step()
    rep = par.memory_report()
    check_report(f"stage {stage} at {N} ranks", rep, psi, len(par.units), formula(stage, psi))
    total = rep["params"] + rep["grads"] + rep["optimizer"]
    if N > 1:
        assert total < 16 * psi, f"stage {stage}: {total} bytes is no less than DDP's {16 * psi}"
    if stage == 3:
        assert rep["largest_gathered_unit"] < 4 * psi, rep
    if world.rank == 0:
        print(f"zero{stage} N={N}: psi={psi} {rep}", flush=True)
print("zero memory ok", world.rank, file=sys.stderr)
