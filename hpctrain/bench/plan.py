"""How close ``hpctrain plan`` is: every plan it prices for a tiny gpt and the bench's
Linear stack, run for one step at this world size, estimate vs measured per rank.

Run under mpirun (``mpirun -n 4 python -m hpctrain bench plan``). Measured: the strategy's
``memory_report()`` (params + grads + optimizer state + the largest gathered unit: the bytes
each rank holds) and the peak bytes autograd keeps saved for backward during the step
(plan/saved.py), each the maximum over ranks, as the estimate prices the busiest rank.
Targets: params + grads + optimizer state within 10 %, activations within 20 % (with
activation checkpointing: what stays saved, without the one block recomputed at a time,
which the hooks cannot see). The gathered units of zero3/fsdp are shown beside, not
judged: the estimate's largest unit (two for fsdp, which prefetches) against the engine's
peak of units gathered at once (a tiny model's root unit shows up there too).
"""

from __future__ import annotations

import contextlib
import io
import os
import time

import torch
from torch import nn

from hpctrain.plan.candidates import Request, candidates, config_of
from hpctrain.plan.estimate import estimate
from hpctrain.plan.model_shape import gpt_shape, stack_shape
from hpctrain.plan.saved import SavedTensorMeter

__all__ = ["GPT_DIMS", "STACK", "measure_all", "run", "STATES_TOLERANCE",
           "ACTIVATION_TOLERANCE"]

GPT_DIMS = dict(layers=2, hidden=48, heads=4, vocab=68, seq=32)
STACK = dict(width=64, layers=4)
STATES_TOLERANCE, ACTIVATION_TOLERANCE = 0.10, 0.20


def _stack_sequential() -> nn.Sequential:
    """The bench's Stack (workload.py) as layers: Linear + ReLU per block."""
    from hpctrain.bench.workload import Stack

    stack = Stack(STACK["width"], STACK["layers"])
    return nn.Sequential(*(nn.Sequential(b, nn.ReLU()) for b in stack.blocks))


def _square_loss(out, _target):
    return out.square().mean()


DEFAULT_MODELS = ("gpt", "stack")


def _models():
    """(name, shape, build(pipeline: bool) -> model, batch(n) -> (x, y), loss_fn)."""
    from hpctrain.models import gpt, registry
    from hpctrain.models.layers import from_sequential

    d = GPT_DIMS
    opts = dict(layers=d["layers"], d_model=d["hidden"], heads=d["heads"], vocab=d["vocab"],
                seq_len=d["seq"], n_samples=64)

    def gpt_build(pipeline):
        return (registry.build_layers if pipeline else registry.build)("gpt", 0, **opts).model

    def gpt_batch(n, g):
        x = torch.randint(0, d["vocab"], (n, d["seq"]), generator=g)
        return x, torch.randint(0, d["vocab"], (n, d["seq"]), generator=g)

    seq = _stack_sequential()
    w = STACK["width"]
    stack = stack_shape("stack", {}, from_sequential(seq), torch.zeros(1, w), torch.zeros(1),
                        _square_loss, whole=seq)

    def stack_build(pipeline):
        torch.manual_seed(0)
        s = _stack_sequential()
        return from_sequential(s) if pipeline else s

    def stack_batch(n, g):
        return torch.randn(n, w, generator=g), torch.zeros(n)

    return [("gpt", gpt_shape(**d), gpt_build, gpt_batch, gpt.lm_loss),
            ("stack", stack, stack_build, stack_batch, _square_loss), _hf_gpt2(gpt_batch)]


def _hf_gpt2(gpt_batch):
    """A tiny Hugging Face GPT-2 (random init, the gpt's dimensions), priced as `hpctrain
    plan` prices a user's model: split into its layers (models/chain.py)."""
    from hpctrain.models import gpt
    from hpctrain.plan.model_shape import shape_of

    spec = "hpctrain.bench.plan:hf_gpt2_factory"

    def build(pipeline):
        return hf_gpt2_factory()[0]

    return ("hf-gpt2", lambda: shape_of(spec), build, gpt_batch, gpt.lm_loss)


def hf_gpt2_factory():
    """(tiny HF GPT-2 returning logits, token data, lm_loss): a user factory for the plan."""
    import transformers

    from hpctrain.data.synthetic import make_markov_tokens
    from hpctrain.models import gpt

    d = GPT_DIMS

    class Logits(transformers.GPT2LMHeadModel):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids, use_cache=False).logits

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=d["vocab"], n_positions=d["seq"],
                                  n_embd=d["hidden"], n_layer=d["layers"], n_head=d["heads"],
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return Logits(cfg), make_markov_tokens(64, d["seq"], d["vocab"], 0, 3), gpt.lm_loss


def _measure(world, c, req, shape, build, batch, loss_fn, checkpointing: bool) -> tuple:
    """(max over ranks of model-state bytes, of peak saved-activation bytes) for one step."""
    from hpctrain.parallel.orchestrator import apply_plan
    from hpctrain.train.precision import Precision
    from hpctrain.train.optimizers import make_optimizer_factory
    from hpctrain.train.plan_options import plan_options

    cfg = config_of(c, req, shape.spec, shape.options, checkpointing).validate(world.size)
    plan = cfg.plan(world.size)
    model = build(c.pp > 1)
    with contextlib.redirect_stdout(io.StringIO()):  # the plan's log lines, per case
        par = apply_plan(plan, model, make_optimizer_factory(cfg.train), world,
                          plan_options(cfg, plan.flavour), checkpointing)
    g = torch.Generator().manual_seed(0)  # every rank the same replica batch: sizes only
    x, y = batch(req.global_batch // c.dp, g)
    meter = SavedTensorMeter(lambda: list(par.model.parameters()))
    with meter:
        par.forward_backward([(x, y, 1.0)], loss_fn, Precision("fp32", torch.device("cpu")))
    # Horovod's optimizer drops the gradients at its step: read them while they exist
    grads = sum({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                 for p in par.model.parameters() if p.grad is not None}.values())
    par.step()
    r = par.memory_report()
    states = r["params"] + (r["grads"] or grads) + r["optimizer"]
    gathered = r.get("peak_gathered", 0)
    out = tuple(world.mpi_comm.allreduce(v, op=_max()) for v in (states, gathered, meter.peak))
    return out


def _max():
    from mpi4py import MPI

    return MPI.MAX


def measure_all(world, models=None, checkpointing=(False, True)) -> list:
    """One row per (model, plan, activation checkpointing): estimate vs measured."""
    req = Request(ranks=world.size, ranks_per_node=world.size, memory_gb=1e3,
                  precision="fp32", optimizer="adamw", global_batch=16, microbatches=4)
    rows = []
    for name, shape, build, batch, loss_fn in _models():
        if name not in (models or DEFAULT_MODELS):
            continue
        if callable(shape):  # priced only when asked for (hf-gpt2 imports transformers)
            shape = shape()
        plans, _ = candidates(shape, req)
        for c in plans:
            est = estimate(shape, c, req)
            for ac in checkpointing:
                states, gathered, act = _measure(world, c, req, shape, build, batch,
                                                 loss_fn, ac)
                # the meter sees what autograd keeps, not a block's recompute in backward
                act_est = est.activations_kept if ac else est.activations
                rows.append({"model": name, "plan": c.label(), "checkpointing": ac,
                             "states_est": est.params + est.grads + est.optimizer,
                             "states_measured": states, "gathered_est": est.gathered,
                             "gathered_measured": gathered, "act_est": act_est,
                             "act_measured": act})
    return rows


def _verdict(est: float, measured: float, tol: float) -> tuple:
    ratio = est / measured if measured else float("inf")
    return ratio, "PASS" if abs(ratio - 1) <= tol else "FAIL"


def table(rows: list, world_size: int) -> tuple[str, bool]:
    """The accuracy table as text, and whether every row passed."""
    lines = [f"plan bench: {world_size} ranks, fp32 AdamW, global batch 16, pipeline 4 "
             f"micro-batches; gpt {GPT_DIMS}, stack {STACK['layers']} x Linear "
             f"{STACK['width']}; bytes per rank (max over ranks)",
             f"  {'model':<8}{'plan':<31}{'AC':<4}{'states est':>11}{'measured':>10}"
             f"{'ratio':>7}{'':>6}{'activ est':>11}{'measured':>10}{'ratio':>7}{'':>6}"
             f"{'gathered est':>13}{'peak':>9}"]
    ok = True
    for r in rows:
        sr, sv = _verdict(r["states_est"], r["states_measured"], STATES_TOLERANCE)
        ar, av = _verdict(r["act_est"], r["act_measured"], ACTIVATION_TOLERANCE)
        ok &= sv == av == "PASS"
        lines.append(f"  {r['model']:<8}{r['plan']:<31}{'on' if r['checkpointing'] else 'off':<4}"
                     f"{r['states_est']:>11,.0f}{r['states_measured']:>10,}{sr:>7.3f} {sv:<5}"
                     f"{r['act_est']:>11,.0f}{r['act_measured']:>10,}{ar:>7.3f} {av:<5}"
                     f"{r['gathered_est']:>13,.0f}{r['gathered_measured']:>9,}")
    n_fail = sum("FAIL" in line for line in lines[2:])
    lines.append(f"  {len(rows)} cases: model states within {STATES_TOLERANCE:.0%}, "
                 f"activations within {ACTIVATION_TOLERANCE:.0%}: "
                 f"{'all PASS' if ok else f'{n_fail} with a FAIL'}")
    return "\n".join(lines), ok


def run(models=(), checkpointing=(False, True)) -> int:
    from hpctrain.runtime.world import init_world

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = init_world(device="cpu")
    t0 = time.perf_counter()
    rows = measure_all(world, models, checkpointing)
    text, ok = table(rows, world.size)
    if world.rank == 0:
        print(text)
        print(f"  ({time.perf_counter() - t0:.1f} s)")
    world.mpi_comm.Barrier()
    return 0 if ok else 1
