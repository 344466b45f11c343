"""Under mpirun: fsdp's per-rank memory after a step matches the ZeRO fp32-Adam formulas for
each sharding strategy; gathered params and full grads really are freed; backward prefetch
gathers the next unit ahead; non-final micro-batches do not communicate gradients. For every
reduce_bucket_size / allgather_bucket_size (the defaults, one that splits every unit and
prefetches none, one larger than the model) the transient buffers stay within their
budgets and the rank's peak within 1.05x of formula + buffers; with the other sizes two
steps match one process to rtol 1e-5 (the defaults: test_fsdp_equivalence)."""

import sys

import torch

from hpctrain.models.gpt import GPT, lm_loss
from hpctrain.parallel.fsdp import DEFAULT_ALLGATHER_BUCKET_BYTES, FSDPOptions, wrap
from hpctrain.parallel.sharding.reduction import DEFAULT_BUCKET_BYTES
from hpctrain.runtime.world import init_world
from tests.parallel.memory_check import BUCKETS, check_buffers, check_matches, check_report

world = init_world()
N = world.size
PER_NODE = world.local_size


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def formula(strategy, psi):
    """(params, grads, optimizer) bytes per rank held after a step, fp32 Adam."""
    shards = {"FULL_SHARD": N, "SHARD_GRAD_OP": N, "NO_SHARD": 1, "HYBRID_SHARD": PER_NODE}[strategy]
    return 4 * psi / shards, 4 * psi / shards, 8 * psi / shards


class Counting:
    """Wraps a communicator and counts the gradient collectives that go through it (the
    engine starts them non-blocking in the hooks)."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []

    def __getattr__(self, name):
        attr = getattr(self.comm, name)
        if name in ("reduce_scatter", "allreduce", "ireduce_scatter", "iallreduce"):
            def counted(*a, **k):
                self.calls.append(name)
                return attr(*a, **k)
            return counted
        return attr


def build():
    torch.manual_seed(0)
    return GPT(vocab=67, d_model=48, heads=4, layers=4, seq_len=32)


torch.manual_seed(0)
tokens = torch.randint(0, 67, (4, 33))
x, y = tokens[:, :-1], tokens[:, 1:]
# One process: two steps of two micro-batches on the whole batch (every rank holds it; each
# rank's loss is 1/(2N) of it per micro-batch and the ranks' gradients are summed).
ref = build()
opt = make_opt(ref.parameters())
for _ in range(2):
    for _ in range(2):
        (lm_loss(ref(x), y) / 2).backward()
    opt.step()
    opt.zero_grad()
want_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}

peaks = {}
CASES = [(s, p, None) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
         for p in ("BACKWARD_PRE", "NONE") if p == "BACKWARD_PRE" or s == "FULL_SHARD"]
CASES += [(s, "BACKWARD_PRE", b) for s in ("FULL_SHARD", "HYBRID_SHARD") for b in BUCKETS[1:]]
for strategy, prefetch, bucket in CASES:
    label = f"{strategy} prefetch={prefetch} buckets={bucket} at {N} ranks"
    model = build()
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied once
    sizes = {} if bucket is None else {"reduce_bucket_size": bucket,
                                       "allgather_bucket_size": bucket}
    opts = FSDPOptions(sharding_strategy=strategy, backward_prefetch=prefetch, grad_accum=2,
                       **sizes)
    par = wrap(model, make_opt, world, opts)
    sharded = strategy != "NO_SHARD"
    # Micro-batch 1 of 2: gradients accumulate locally, no gradient communication.
    par.comm = Counting(par.comm)
    if par.replicate is not None:
        par.replicate = Counting(par.replicate)
    out = par.model(x)
    if strategy in ("FULL_SHARD", "HYBRID_SHARD"):  # resharded after forward
        held = [u.full.untyped_storage().nbytes() for u in par.units]
        assert held == [0] * len(held), f"{strategy} kept gathered units after forward: {held}"
    if strategy == "SHARD_GRAD_OP":  # kept from forward to backward
        assert all(u.gathered for u in par.units), strategy
    par.backward(lm_loss(out, y) / (2 * N))
    counted = par.comm.calls + (par.replicate.calls if par.replicate is not None else [])
    assert counted == [], f"{strategy}: non-final micro-batch communicated {counted}"
    assert all(p.grad is not None for p in model.parameters()), strategy
    # Micro-batch 2 of 2: every unit's gradients reduced during backward, full ones freed.
    par.backward(lm_loss(par.model(x), y) / (2 * N))
    counted = par.comm.calls + (par.replicate.calls if par.replicate is not None else [])
    assert counted, f"{strategy}: the final micro-batch reduced nothing"
    # A prefetch started non-blocking (gather_start) was completed by its unit's backward.
    assert not any(u.pending for u in par.units), strategy
    left = [n for n, p in model.named_parameters() if p.grad is not None]
    assert not left, f"{strategy} kept full gradients after backward: {left}"
    if sharded and par.comm.size > 1:
        held = [u.full.untyped_storage().nbytes() for u in par.units]
        assert held == [0] * len(held), f"{strategy} kept gathered units after backward"
    par.comm = par.comm.comm
    if par.replicate is not None:
        par.replicate = par.replicate.comm
    par.step()
    rep = par.memory_report()
    check_report(label, rep, psi, len(par.units), formula(strategy, psi))
    ratio = check_buffers(label, rep, formula(strategy, psi), par.units,
                          bucket or DEFAULT_BUCKET_BYTES,
                          bucket or DEFAULT_ALLGATHER_BUCKET_BYTES, overlapped=True,
                          prefetch=prefetch == "BACKWARD_PRE" and strategy != "SHARD_GRAD_OP"
                          and sharded and par.comm.size > 1,
                          keep_gathered=strategy == "SHARD_GRAD_OP", accum=2)
    if bucket is None:
        peaks[(strategy, prefetch)] = rep["peak_gathered"]
    if world.rank == 0:
        print(f"fsdp {label}: psi={psi} peak/(formula+buffers)={ratio:.3f} {rep}",
              flush=True)
    unit_bytes = sorted(u.full_bytes() for u in par.units)
    if strategy == "FULL_SHARD" and N > 1:
        # Backward holds the root, the unit it computes and (prefetch) the next one.
        root = par.units[-1].full_bytes()
        block = unit_bytes[-1] if unit_bytes[-1] != root else unit_bytes[-2]
        limit = root + (2 if prefetch == "BACKWARD_PRE" else 1) * block
        assert rep["peak_gathered"] <= limit, (prefetch, rep["peak_gathered"], limit)
        assert rep["peak_gathered"] < 4 * psi, rep
    if bucket is not None:  # (the default sizes: test_fsdp_equivalence)
        for _ in range(2):  # the second step: both match one process
            par.backward(lm_loss(par.model(x), y) / (2 * N))
        par.step()
        check_matches(label, par.full_state_dict(), want_state)
if N > 1:
    # Prefetch really gathers ahead: one more unit is in memory at once than without it.
    assert peaks[("FULL_SHARD", "BACKWARD_PRE")] > peaks[("FULL_SHARD", "NONE")], peaks
    # SHARD_GRAD_OP holds every unit at the end of forward.
    assert peaks[("SHARD_GRAD_OP", "BACKWARD_PRE")] >= 4 * psi, peaks
print("fsdp memory ok", world.rank, file=sys.stderr)
