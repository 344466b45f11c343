"""Under mpirun: the sharded engine's piecewise reduce-scatter gives every rank exactly its
slice of the summed gradients, for pieces of the default size and for tiny pieces (many of
them, a short last one, padding in the last rank's shard, a piece straddling two params),
and its transient packing buffer stays within the piece size."""

import copy
import sys

import torch
from torch import nn

from hpctrain.parallel import wrap
from hpctrain.parallel.fsdp import FSDPOptions
from hpctrain.parallel.sharding import engine
from hpctrain.parallel.zero import ZeroOptions
from hpctrain.runtime.world import init_world

world = init_world()
N = world.size
DEFAULT_PIECE, DEFAULT_MIN = engine._PIECE_BYTES, engine._MIN_RANK_PIECE_BYTES


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


def options(strategy):
    if strategy == "fsdp":
        return FSDPOptions()
    return ZeroOptions(stage=int(strategy[-1]))


checked = 0
for piece in (DEFAULT_PIECE, 64):  # 64 bytes: 4 elements per rank per piece at 4 ranks
    engine._PIECE_BYTES = piece
    engine._MIN_RANK_PIECE_BYTES = 4 if piece < DEFAULT_PIECE else DEFAULT_MIN
    for strategy in ("zero2", "zero3", "fsdp"):
        torch.manual_seed(0)
        model = Net()
        ref_model = copy.deepcopy(model)
        x = torch.randn(5, 37, generator=torch.Generator().manual_seed(10 + world.rank))
        want = reference_grads(ref_model, x)
        par = wrap(strategy, model, lambda ps: torch.optim.SGD(ps, lr=0.1), world,
                   options(strategy))
        par.backward(par.model(x).square().sum())
        for u in par.units:
            flat = torch.zeros(u.padded)
            for s in u.slots:
                flat[s.offset:s.offset + s.numel] = want[s.name].reshape(-1)
            got = u.shard.grad
            assert got is not None, (strategy, piece, u.name)
            torch.testing.assert_close(got, flat[u.lo:u.hi], rtol=1e-6, atol=1e-6,
                                       msg=f"{strategy} piece={piece} unit {u.name}")
            checked += 1
        rep = par.memory_report()
        if N > 1:
            # The packing buffer never exceeds a piece (at least one element per rank).
            assert rep["transient_grad_bucket"] <= max(piece, 4 * N), (strategy, piece, rep)
        par.step()
assert checked == 12, checked
print("grad pieces ok", world.rank, file=sys.stderr)
