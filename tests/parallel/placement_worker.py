"""mpirun worker for test_placement: parameters placed as tensor-parallel slices, sharded by
the data-parallel flavours, trained two steps, checkpointed, and loaded at other splits.

    python -m tests.parallel.placement_worker write DIR TP [read DIR TP]...
    python -m tests.parallel.placement_worker read DIR TP

(MODE DIR TP triples run one after another in the one process.)

The model: a (10, 6) weight split by rows over tp with its bias, a (5, 10) weight split by
columns over tp, and a (5,) bias every tp rank holds whole (its gradient the same on each:
counted once in norms, written once). Every rank computes the one-process reference itself.
The loss is sum(param * C) / dp, so the summed gradient of every element is C.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

from hpctrain.checkpoint.reader import Reader
from hpctrain.checkpoint.state import write_entries
from hpctrain.parallel import fsdp, zero
from hpctrain.parallel.base import DPGroups
from hpctrain.parallel.placement import Copies, Placement, place
from hpctrain.runtime.mesh import MeshLayout
from hpctrain.runtime.world import init_world

SHAPES = {"layers.0.weight": (10, 6), "layers.0.bias": (10,), "layers.1.weight": (5, 10),
          "layers.1.bias": (5,)}
# tensor dim split over tp; the last bias is whole on every tp rank
SPLIT = {"layers.0.weight": 0, "layers.0.bias": 0, "layers.1.weight": 1}
FLAVOURS = ["zero1", "zero2", "zero3", "fsdp-NO_SHARD", "fsdp-FULL_SHARD"]
STEPS, LR, CLIP = 2, 0.05, 0.5


def full_values():
    g = torch.Generator().manual_seed(3)
    params = {k: torch.randn(s, generator=g, dtype=torch.float64).float() for k, s in SHAPES.items()}
    coef = {k: torch.randn(s, generator=g, dtype=torch.float64).float() for k, s in SHAPES.items()}
    return params, coef


def reference():
    """One process: AdamW steps on gradient C, clipped to CLIP."""
    params, coef = full_values()
    ps = {k: nn.Parameter(v.clone()) for k, v in params.items()}
    opt = torch.optim.AdamW(ps.values(), lr=LR, weight_decay=0.01)
    for _ in range(STEPS):
        for k, p in ps.items():
            p.grad = coef[k].clone()
        torch.nn.utils.clip_grad_norm_(ps.values(), CLIP)
        opt.step()
    return {k: p.detach() for k, p in ps.items()}, {k: opt.state[p] for k, p in ps.items()}


def cut(n: int, parts: int, i: int) -> tuple[int, int]:
    return n * i // parts, n * (i + 1) // parts


def piece(name: str, t: torch.Tensor, tp_rank: int, tp: int):
    """(this tp rank's slice of the global t, its offset or None)."""
    if name not in SPLIT or tp == 1:
        return t, None
    d = SPLIT[name]
    a, b = cut(t.shape[d], tp, tp_rank)
    offset = tuple(a if i == d else 0 for i in range(t.dim()))
    return t.narrow(d, a, b - a), offset


class Net(nn.Module):
    """Its forward is the loss sum(param * C): on-demand flavours gather in it."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 5))

    def forward(self, coef: dict):
        return sum((p * coef[n]).sum() for n, p in self.named_parameters())


def sliced_model(tp_comm, tp: int):
    params, coef = full_values()
    model = Net()
    local_coef = {}
    for name, p in list(model.named_parameters()):
        mod, attr = model.layers[int(name.split(".")[1])], name.split(".")[2]
        value, offset = piece(name, params[name], tp_comm.rank, tp)
        new = nn.Parameter(value.clone())
        setattr(mod, attr, new)
        local_coef[name] = piece(name, coef[name], tp_comm.rank, tp)[0].clone()
        tp_group = Copies("tp", tp_comm, partial=False)
        if offset is None:
            place(new, Placement(SHAPES[name]).with_copies(tp_group))
        else:
            place(new, Placement(SHAPES[name], offset, sliced_over=(tp_group,)))
    return model, local_coef


def wrap(flavour: str, model, world, dp):
    make = lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)
    groups = DPGroups(dp, (), dp)
    # one unit: parameters sliced and whole in one flat buffer (their norm weights differ)
    if flavour.startswith("zero"):
        opts = zero.ZeroOptions(stage=int(flavour[-1]), auto_wrap_policy="none")
        return zero.wrap(model, make, world, opts, groups)
    opts = fsdp.FSDPOptions(sharding_strategy=flavour[5:], auto_wrap_policy="none")
    return fsdp.wrap(model, make, world, opts, groups)


def check_slices(par, want: dict, tp_rank: int, tp: int, what: str):
    state = par.full_state_dict()  # shards gathered over dp; each rank's tp slice
    for name, full in want.items():
        expect = piece(name, full, tp_rank, tp)[0]
        torch.testing.assert_close(state[name], expect, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what} {name}: {m}")


def main() -> int:
    world = init_world()
    args = sys.argv[1:]
    for i in range(0, len(args), 3):  # MODE DIR TP, again and again: one process start
        run(world, args[i], args[i + 1], int(args[i + 2]))
    return 0


def run(world, mode: str, directory: str, tp: int) -> None:
    mesh = world.mesh(MeshLayout.parse(f"dp={world.size // tp},tp={tp}").resolve(world.size))
    tp_comm, dp = mesh.comm("tp"), mesh.comm("dp")
    want, want_state = reference()
    full_norm = float(torch.sqrt(sum(p.double().pow(2).sum() for p in want.values())))
    for flavour in FLAVOURS:
        path = os.path.join(directory, f"{flavour}.h5")
        model, coef = sliced_model(tp_comm, tp)
        par = wrap(flavour, model, world, dp)
        if mode == "write":
            for _ in range(STEPS):
                par.backward(par.model(coef) / dp.size)
                par.step(max_grad_norm=CLIP)
            check_slices(par, want, tp_comm.rank, tp, f"{flavour} trained")
            norm = par.param_norm()
            assert abs(norm - full_norm) <= 1e-5 * full_norm, (flavour, norm, full_norm)
            meta = par.state_meta()
            write_entries(path, par.state_entries(),
                          {k: json.dumps(v) for k, v in meta.items()}, world.mpi_comm)
        else:
            with Reader(path) as reader:
                par.load_state_entries(reader)
                reader.check(world.mpi_comm)
            check_slices(par, want, tp_comm.rank, tp, f"{flavour} loaded")
            with Reader(path) as reader:  # the global tensors, as single and export see them
                for name, full in want.items():
                    got = torch.from_numpy(reader.read(f"model/{name}"))
                    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
                    got = torch.from_numpy(reader.read(f"optim/{name}/exp_avg"))  # noqa
                    torch.testing.assert_close(got, want_state[name]["exp_avg"], rtol=1e-5,
                                               atol=1e-7)
                    step = float(reader.read(f"optim/{name}/step"))
                    assert step == STEPS, (name, step)
        world.mpi_comm.Barrier()
    sys.stdout.write(f"rank {world.rank}: OK {mode}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
