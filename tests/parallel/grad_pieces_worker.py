"""Under mpirun: the sharded engine's piecewise reduce-scatter gives every rank exactly its
slice of the summed gradients, for pieces of the default size and for tiny pieces (many of
them, a short last one, padding in the last rank's shard, a piece straddling two params),
whether the reductions started in the backward hooks run far ahead of their completion
(the default cap on bytes in flight) or are forced to complete after a few pieces (a tiny
cap), and when a second backward runs before the step (zero1: reduced at the step, as
before); the bytes in flight
(transient_grad_bucket) stay within the cap; the blocking reduce_scatter_grads gives the
same shards bit for bit (2 ranks: two summands add the same in any order)."""

import copy
import sys

import torch
from torch import nn

from hpctrain.parallel import wrap
from hpctrain.parallel.fsdp import FSDPOptions
from hpctrain.parallel.sharding import reduction
from hpctrain.parallel.zero import ZeroOptions
from hpctrain.runtime.world import init_world

world = init_world()
N = world.size
DEFAULT_PIECE, DEFAULT_MIN = reduction._PIECE_BYTES, reduction._MIN_RANK_PIECE_BYTES
DEFAULT_CAP = reduction._INFLIGHT_BYTES


class Net(nn.Module):
    # 37*29+29 = 1102 and 29*13+13 = 390 elements: not multiples of 4, so shards are padded.
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(37, 29), nn.Linear(29, 13)])

    def forward(self, x):
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def reference_grads(model, x):
    """Each parameter's gradient summed over all ranks, computed on an unsharded copy."""
    model(x).square().sum().backward()
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        world.comm.allreduce(g, op="sum")
        out[name] = g
    return out


def options(strategy, cap):
    if strategy == "fsdp":
        return FSDPOptions(reduce_bucket_size=cap)
    return ZeroOptions(stage=int(strategy[-1]), reduce_bucket_size=cap)


def blocking_shards(model, x):
    """The blocking path's shard gradients (reduce_scatter_grads) on an unsharded copy."""
    from hpctrain.parallel.flat_buffer import FlatUnit

    model(x).square().sum().backward()
    out = []
    for block in model.blocks:
        u = FlatUnit("u", list(block.named_parameters()), world.comm, keep_full=True)
        out.append(reduction.reduce_scatter_grads(u, world.comm)[0])
    return out


checked = 0
CASES = [(DEFAULT_PIECE, DEFAULT_CAP, 1), (64, DEFAULT_CAP, 1), (64, 3 * 64, 1),
         (64, 3 * 64, 2)]
for piece, cap, calls in CASES:
    # 64 bytes: 4 elements per rank per piece at 4 ranks; cap 3 pieces: a hook completes
    # the oldest pieces before it starts more. calls=2: a second backward before the step
    # (its hooks start the units again, adding to the first reduction).
    reduction._PIECE_BYTES = piece
    reduction._MIN_RANK_PIECE_BYTES = 4 if piece < DEFAULT_PIECE else DEFAULT_MIN
    reduction._INFLIGHT_BYTES = cap  # the blocking path's bucket (the engine's: the options)
    for strategy in ("zero1", "zero2", "zero3", "fsdp"):
        torch.manual_seed(0)
        model = Net()
        ref_model = copy.deepcopy(model)
        blk_model = copy.deepcopy(model)
        x = torch.randn(5, 37, generator=torch.Generator().manual_seed(10 + world.rank))
        want = reference_grads(ref_model, x)
        par = wrap(strategy, model, lambda ps: torch.optim.SGD(ps, lr=0.1), world,
                   options(strategy, cap))
        for _ in range(calls):
            par.backward(par.model(x).square().sum())
        if strategy != "zero1":  # started in the hooks, in flight until the synchronize
            assert all(st.reduced for st in par._states) and par._reductions.jobs, strategy
        par._sync_grads()
        pending = par._reductions
        assert not pending.jobs and not pending.inflight and pending.inflight_bytes == 0, strategy
        blocking = blocking_shards(blk_model, x) if N > 1 else None
        for k, u in enumerate(par.units):
            assert u.slots[0].name == f"blocks.{k}.weight", [v.name for v in par.units]
            flat = torch.zeros(u.padded)
            for s in u.slots:
                flat[s.offset:s.offset + s.numel] = calls * want[s.name].reshape(-1)
            got = u.shard.grad
            assert got is not None, (strategy, piece, u.name)
            torch.testing.assert_close(got, flat[u.lo:u.hi], rtol=1e-6, atol=1e-6,
                                       msg=f"{strategy} piece={piece} unit {u.name}")
            if blocking is not None and N == 2 and calls == 1:  # two summands: any order is the same sum
                assert torch.equal(got, blocking[k]), (strategy, piece, cap, u.name)
            checked += 1
        rep = par.memory_report()
        if N > 1 and strategy != "zero1":  # zero1 reduces its flat buffers at the step
            # The piece buffers alive never exceed the cap (at least one piece of at least
            # one element per rank gets through).
            assert rep["transient_grad_bucket"] <= max(cap, piece, 4 * N), \
                (strategy, piece, cap, rep)
            assert rep["transient_grad_bucket"] > 0, (strategy, rep)
# Back to the defaults: the session's launches run other scripts in this process after it.
reduction._PIECE_BYTES, reduction._MIN_RANK_PIECE_BYTES = DEFAULT_PIECE, DEFAULT_MIN
reduction._INFLIGHT_BYTES = DEFAULT_CAP
assert checked == 8 * len(CASES), checked
print("grad pieces ok", world.rank, file=sys.stderr)
