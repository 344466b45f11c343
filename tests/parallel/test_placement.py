"""Placements (no MPI): the copies split the writing of a checkpoint entry exactly, norms
count every element once, slices become N-D boxes. Under mpirun: tensor-parallel-style
slices (rows, columns, a bias held alike by the tp ranks) flat-sharded by zero1/zero2/fsdp
over dp write one checkpoint that single loads, and load back at another split."""

import numpy as np
import pytest
import torch

from hpctrain.checkpoint.layout import owned_region
from hpctrain.parallel.placement import Copies, Placement, entry, global_norm
from tests.mpirun import run_mpi


class FakeComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def _coverage(make, world):
    """Global flat elements each rank writes, for entries from make(rank)."""
    seen = []
    for r in range(world):
        e = make(r)
        region = owned_region(0, e, r, world)
        seen += [x for a, b in region.runs.tolist() for x in range(a, b)]
    return sorted(seen)


@pytest.mark.parametrize("dp,dom", [(1, 1), (2, 1), (3, 2), (2, 2)])
def test_copies_split_the_writing_exactly_once(dp, dom):
    t = torch.arange(35.0).reshape(5, 7)

    def make(rank):
        placed = Placement((5, 7)).with_copies(Copies("dom", FakeComm(rank % dom, dom)),
                                               Copies("dp", FakeComm(rank // dom, dp)))
        return entry("w", t, placed, None, job_size=4 * dp * dom)  # not the whole job

    assert _coverage(make, dp * dom) == list(range(35))


def test_whole_job_copies_are_left_to_the_writer():
    placed = Placement((5, 7)).with_copies(Copies("dp", FakeComm(1, 4)))
    e = entry("w", torch.zeros(5, 7), placed, None, job_size=4)
    assert e.elems is None and e.box is None and e.local.shape == (5, 7)


def test_slices_flat_sharded_and_copied_cover_the_global_tensor_once():
    # a (6, 10) weight: columns split over tp=2 (5 each), each slice flat-sharded over dp=3
    # with uneven shards, a replica group of 2 splitting each shard's writing
    full = torch.arange(60.0).reshape(6, 10)
    tp, dp, rep = 2, 3, 2

    def make(rank):
        t, d, r = rank % tp, rank // tp % dp, rank // (tp * dp)
        local = full[:, 5 * t:5 * t + 5]
        cuts = [0, 7, 19, 30]
        a, b = cuts[d], cuts[d + 1]
        placed = Placement((6, 10), (0, 5 * t), sliced_over=(Copies("tp", FakeComm(t, tp)),))
        placed = placed.with_copies(Copies("replicate", FakeComm(r, rep)))
        e = entry("w", local.reshape(-1)[a:b], placed, (a, b), job_size=tp * dp * rep,
                  local_shape=(6, 5))
        assert e.box == ((0, 5 * t), (6, 5))
        region = owned_region(0, e, rank, tp * dp * rep)
        got = [x for a_, b_ in region.runs.tolist() for x in range(a_, b_)]
        assert torch.equal(full.reshape(-1)[got], e.local.reshape(-1))  # the values line up
        return e

    assert _coverage(make, tp * dp * rep) == list(range(60))


def test_a_scalar_goes_with_the_whole_tensor():
    placed = Placement((6, 10), (0, 5), copies=(Copies("dp", FakeComm(0, 2)),),
                       sliced_over=(Copies("tp", FakeComm(1, 2)),))
    s = placed.scalar()
    assert s.n_copies == 4 and s.global_shape == ()
    writers = 0
    for dp_rank in range(2):
        for tp_rank in range(2):
            p = Placement((), copies=(Copies("dp", FakeComm(dp_rank, 2)),
                                      Copies("tp", FakeComm(tp_rank, 2))))
            writers += entry("step", torch.tensor(3.0), p, None, job_size=8).local.numel()
    assert writers == 1


def test_norm_weights_count_each_element_once():
    # a bias held alike by 2 tp ranks x 3 replicas: each rank's squares count 1/6
    placed = Placement((4,)).with_copies(Copies("tp", FakeComm(0, 2), partial=False),
                                         Copies("dp", FakeComm(0, 3)))
    assert placed.norm_weight == pytest.approx(1 / 6)
    assert placed.sum_comms() == [placed.copies[1].comm]  # the tp copies' grads are the same
    t = torch.tensor([3.0, 4.0])
    assert global_norm([(t, 1.0)], None) == pytest.approx(5.0)
    assert global_norm([(t, 0.25)], FakeSum(4)) == pytest.approx(5.0)


class FakeSum:
    """A job of ``size`` ranks that all hold the same squares."""

    def __init__(self, size):
        self.size = size

    def allreduce_scalars(self, values):
        return [v * self.size for v in values]


def test_box_runs_of_a_sliced_entry():
    e = entry("w", torch.zeros(6, 5), Placement((6, 10), (0, 5)), None, job_size=2)
    region = owned_region(0, e, 0, 2)
    assert region.runs.tolist() == [[10 * r + 5, 10 * r + 10] for r in range(6)]
    assert np.prod(region.boxes[0][1]) == 30


@pytest.mark.mpi
def test_sliced_parameters_through_the_flavours(tmp_path):
    """Written at tp x dp = 2 x 2 (4 ranks) by zero1, zero2 and fsdp (NO_SHARD and
    HYBRID_SHARD); single loads it; tp=4 loads it back; tp=1 x dp=2 too."""
    # written and read back at 4 ranks in one launch (the files closed before the read)
    proc = run_mpi(4, ["-m", "tests.parallel.placement_worker", "write", str(tmp_path), "2",
                       "read", str(tmp_path), "4"], timeout=240)
    assert proc.stdout.count("OK write") == 4, proc.stdout + proc.stderr
    assert proc.stdout.count("OK read") == 4, proc.stdout + proc.stderr
    proc = run_mpi(2, ["-m", "tests.parallel.placement_worker", "read", str(tmp_path), "1"],
                   timeout=240)
    assert proc.stdout.count("OK read") == 2, proc.stdout + proc.stderr
