"""The gather stream of zero3 / fsdp, without MPI: two simulated ranks whose graphs differ (a
branch taken on one rank only) issue the same collectives in the same order, in forward,
backward, grad accumulation, activation checkpointing, prefetch, SHARD_GRAD_OP and eval.

Each simulated rank wraps its own copy of the model over a communicator that only records
what it is asked to do (the op and the element count: a mismatch in either would pair the
wrong all-gathers or hang under MPI); the values it returns are not a real reduction."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hpctrain.parallel import fsdp, zero
from hpctrain.parallel.activation_checkpointing import checkpoint_blocks
from tests.fixtures import branchy


class _RecordingComm:
    """Rank ``rank`` of ``size``; collectives are logged, not communicated."""

    def __init__(self, rank, size=2):
        self.rank, self.size, self.device = rank, size, torch.device("cpu")
        self.log = []

    def allgather(self, src, out=None):
        self.log.append(("allgather", src.numel()))
        full = src.repeat(self.size)
        if out is None:
            return full
        out.copy_(full)
        return out

    def reduce_scatter(self, buf, out=None, op="sum"):
        self.log.append(("reduce_scatter", buf.numel()))
        part = buf[:buf.numel() // self.size].clone()
        if out is None:
            return part
        out.copy_(part)
        return out

    def allreduce(self, t, op="sum"):
        self.log.append(("allreduce", t.numel()))
        return t

    def allreduce_scalars(self, values, op="sum"):
        self.log.append(("allreduce_scalars", len(values)))
        return list(values)

    def broadcast(self, t, root=0):
        return t

    # Non-blocking forms: logged when started (the order that must agree; MPI never matches
    # a blocking collective with a non-blocking one, so they are logged apart), done at once.
    def ireduce_scatter(self, buf, out=None, op="sum"):
        out = self.reduce_scatter(buf, out, op)
        self.log[-1] = ("i" + self.log[-1][0], self.log[-1][1])
        return _Done(out)

    def iallgather(self, src, out=None):
        out = self.allgather(src, out)
        self.log[-1] = ("i" + self.log[-1][0], self.log[-1][1])
        return _Done(out)

    def iallreduce(self, t, op="sum"):
        out = self.allreduce(t, op)
        self.log[-1] = ("i" + self.log[-1][0], self.log[-1][1])
        return _Done(out)


class _Done:
    """A request that is complete."""

    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out

    def test(self):
        return True


def _world(rank):
    comm = _RecordingComm(rank)
    return SimpleNamespace(comm=comm, host=comm, device=torch.device("cpu"), rank=rank, size=2,
                           node=comm, cross=comm, node_rank=0, is_main=rank == 0)


def _wrap(flavour, rank, checkpointing=False, factory=branchy.factory, **opts):
    model, _, _ = factory()
    if checkpointing:
        checkpoint_blocks(model, is_main=False)
    world = _world(rank)
    adamw = lambda params: torch.optim.AdamW(params, lr=0.01)  # noqa: E731
    if flavour == "zero3":
        par = zero.wrap(model, adamw, world, zero.ZeroOptions(stage=3, **opts))
    else:
        par = fsdp.wrap(model, adamw, world, fsdp.FSDPOptions(**opts))
    for u in par.units:  # log which unit each all-gather is for (the blocks' sizes agree)
        u.comm = _Named(u.comm, u.name)
    return par, world.comm


class _Named:
    """A unit's view of the recording communicator: its gathers are logged with its name."""

    def __init__(self, comm, name):
        self.comm, self.name = comm, name
        self.rank, self.size, self.device = comm.rank, comm.size, comm.device

    def allgather(self, src, out=None):
        self.comm.log.append(("gather", self.name))
        return self.comm.allgather(src, out)

    def iallgather(self, src, out=None):
        self.comm.log.append(("igather", self.name))
        return self.comm.iallgather(src, out)


def _batch(branch, n=2, seed=0):
    """A batch that takes blocks[1] (branch 1) or blocks[2] (branch 2) of BranchyNet."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    x[:, 0] = x[:, 0].abs() + 0.1 if branch == 1 else -x[:, 0].abs() - 0.1
    return x, torch.randn(n, 3, generator=g)


def _steps(par, branches, accum=1, evaluate=False):
    """Train one step per entry of ``branches`` (``accum`` micro-batches each, each with
    its branch); ``evaluate``: a no-grad forward before each step."""
    for k, per_micro in enumerate(branches):
        if evaluate:
            with torch.no_grad():
                par.model(_batch(per_micro[-1], seed=100 + k)[0])
        for m in range(accum):
            x, y = _batch(per_micro[m % len(per_micro)], seed=10 * k + m)
            par.backward(F.mse_loss(par.model(x), y) / accum)
        par.step()
    par.param_norm()


FLAVOURS = {
    "zero3": ("zero3", {}),
    "fsdp-full-prefetch": ("fsdp", {"backward_prefetch": "BACKWARD_PRE"}),
    "fsdp-full-no-prefetch": ("fsdp", {"backward_prefetch": "NONE"}),
    "fsdp-shard-grad-op": ("fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}),
}

# Per rank: the branch of each step's micro-batches.
PATTERNS = {
    "one-branch-each": ([(1,), (1,), (2,)], [(2,), (2,), (2,)], 1),
    "accum-mixed": ([(1, 2), (2, 2)], [(2, 1), (1, 1)], 2),
}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("evaluate", [False, True], ids=["train", "eval-then-train"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_ranks_with_different_branches_issue_the_same_collectives(flavour, pattern, evaluate,
                                                                 checkpointing):
    kind, opts = FLAVOURS[flavour]
    logs = []
    for rank in (0, 1):
        branches, accum = PATTERNS[pattern][rank], PATTERNS[pattern][2]
        par, comm = _wrap(kind, rank, checkpointing, grad_accum=accum, **opts)
        _steps(par, branches, accum, evaluate)
        logs.append(comm.log)
        assert not any(u.gathered for u in par.units)
        assert par.schedule.ooo_gathers == 0
    assert logs[0] == logs[1]
    assert sum(op == "allgather" for op, _ in logs[0]) > 0


def test_same_graph_with_the_other_branch_gathers_it_once_per_pass():
    """A rank that skips a unit still gathers it exactly once per forward and once per
    backward (and frees it at once): the memory of one unit, not of the model."""
    par, comm = _wrap("zero3", 0)
    x, y = _batch(1)
    peak_before = par.schedule.peak_gathered
    par.backward(F.mse_loss(par.model(x), y))
    n_units = len(par.units)
    gathers = [n for op, n in comm.log if op in ("gather", "igather")]
    assert len(gathers) == 2 * n_units
    sizes = sorted(u.full_bytes() for u in par.units)
    # The root (stem and head) stays gathered; at most two blocks are held besides it.
    root = par.units[-1].full_bytes()
    assert par.schedule.peak_gathered <= root + 2 * sizes[-1], (peak_before, sizes)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_units_run_out_of_order_the_same_everywhere_then_a_skip(flavour):
    """Blocks run out of registration order and one twice, the same on every rank, then a
    block only rank 0 runs: the extra gathers and late reductions are the same on both
    ranks (and the step agrees on them)."""
    kind, opts = FLAVOURS[flavour]
    logs = []
    for rank in (0, 1):
        par, comm = _wrap(kind, rank, factory=branchy.factory_reordered, **opts)
        _steps(par, [(1 + rank,), (1 + rank,)])
        logs.append(comm.log)
        assert not any(u.gathered for u in par.units)
    assert logs[0] == logs[1]


def test_ranks_that_gather_out_of_order_differently_are_told_at_the_step():
    par, comm = _wrap("zero3", 0)
    x, y = _batch(1)
    par.backward(F.mse_loss(par.model(x), y))
    par.schedule.ooo_gathers = 3  # as if this rank alone had run a unit again

    def disagree(t, op="sum"):  # the other rank counted none
        t[-2], t[-1] = 255, 255
        return t

    comm.allreduce = disagree
    with pytest.raises(RuntimeError, match="out of the canonical order"):
        par.step()
