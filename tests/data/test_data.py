"""GlobalBatchSampler: world-size independence, uneven splits, checkpoints; collate; errors."""

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from hpctrain.data import GlobalBatchSampler, TensorPairDataset, collate


def _ranks(dataset_len, gbs, world_size, grad_accum, seed=5):
    return [GlobalBatchSampler(dataset_len, gbs, seed, r, world_size, grad_accum)
            for r in range(world_size)]


@pytest.mark.parametrize("gbs", [12, 7])
@pytest.mark.parametrize("grad_accum", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_union_over_ranks_matches_world_size_one(world_size, grad_accum, gbs):
    n = 50  # 50 // 12 = 4 steps per epoch, 50 // 7 = 7: steps 0..14 cross epoch boundaries
    ref = GlobalBatchSampler(n, gbs, 5, 0, 1, grad_accum)
    ranks = _ranks(n, gbs, world_size, grad_accum)
    for step in range(15):
        want = ref.micro_batches(step)
        per_rank = [s.micro_batches(step) for s in ranks]
        assert len(want) == grad_accum and all(len(p) == grad_accum for p in per_rank)
        for m in range(grad_accum):
            got = torch.cat([p[m] for p in per_rank])
            assert torch.equal(got, want[m]), (step, m)
        # Micro-batches in order rebuild the global batch.
        assert torch.equal(torch.cat(want), ref.global_batch(step))


def test_global_batch_does_not_depend_on_grad_accum_or_rank():
    a = GlobalBatchSampler(40, 8, 1, 0, 1, 1)
    b = GlobalBatchSampler(40, 8, 1, 2, 3, 4)
    for step in range(12):
        assert torch.equal(a.global_batch(step), b.global_batch(step))


def test_epochs_are_permutations_and_drop_last_partial_batch():
    s = GlobalBatchSampler(50, 12, 3, 0, 1)
    assert s.steps_per_epoch == 4
    epoch0 = torch.cat([s.global_batch(k) for k in range(4)])
    epoch1 = torch.cat([s.global_batch(k) for k in range(4, 8)])
    for ep in (epoch0, epoch1):
        assert ep.numel() == 48 and ep.unique().numel() == 48  # 2 samples dropped, no repeats
        assert int(ep.min()) >= 0 and int(ep.max()) < 50
    assert not torch.equal(epoch0, epoch1)  # a fresh permutation each epoch
    assert s.epoch_of(3) == 0 and s.epoch_of(4) == 1
    # An epoch's permutation is the same no matter which step is asked first.
    fresh = GlobalBatchSampler(50, 12, 3, 0, 1)
    assert torch.equal(fresh.global_batch(5), s.global_batch(5))


def test_seed_determinism():
    a, b = GlobalBatchSampler(64, 8, 11, 0, 1), GlobalBatchSampler(64, 8, 11, 0, 1)
    c = GlobalBatchSampler(64, 8, 12, 0, 1)
    assert all(torch.equal(a.global_batch(k), b.global_batch(k)) for k in range(10))
    assert not all(torch.equal(a.global_batch(k), c.global_batch(k)) for k in range(10))


def test_uneven_splits_and_empty_ranks():
    # gbs 7, grad_accum 3 -> micro-batches of 3, 2, 2; over 4 ranks: [1,1,1,0] and [1,1,0,0].
    ranks = _ranks(30, 7, 4, 3)
    sizes = [[len(mb) for mb in s.micro_batches(0)] for s in ranks]
    assert sizes == [[1, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0]]
    # gbs 10 over 3 ranks, no accumulation -> 4, 3, 3.
    assert [len(s.micro_batches(2)[0]) for s in _ranks(30, 10, 3, 1)] == [4, 3, 3]


def test_iteration_and_state_dict_resume():
    s = GlobalBatchSampler(50, 6, 2, 1, 2, 2)
    first = [next(s) for _ in range(3)]
    assert s.state_dict() == {"step": 3}
    for k, mbs in enumerate(first):
        assert all(torch.equal(x, y) for x, y in zip(mbs, s.micro_batches(k)))
    resumed = GlobalBatchSampler(50, 6, 2, 1, 2, 2)
    resumed.load_state_dict(s.state_dict())
    for _ in range(10):  # crosses the epoch boundary at step 8
        assert all(torch.equal(x, y) for x, y in zip(next(s), next(resumed)))
    with pytest.raises(ValueError, match="step"):
        resumed.load_state_dict({})


def test_returned_indices_do_not_alias_the_cached_permutation():
    s = GlobalBatchSampler(20, 4, 0, 0, 1)
    mb = s.micro_batches(0)[0]
    before = s.global_batch(0)
    mb.fill_(-1)
    assert torch.equal(s.global_batch(0), before)


class _ListDataset(Dataset):
    """A plain map-style data set (exercises collate's generic path)."""

    def __init__(self, n):
        self.items = [(torch.full((3, 2), float(i)), torch.tensor([i, i + 1])) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("make", [
    lambda: _ListDataset(9),
    lambda: TensorPairDataset(torch.arange(54.).view(9, 3, 2), torch.arange(18).view(9, 2)),
    lambda: TensorDataset(torch.arange(54.).view(9, 3, 2), torch.arange(18).view(9, 2)),
])
def test_collate_stacks_and_handles_empty(make):
    ds = make()
    x, y = collate(ds, torch.tensor([4, 0, 7]))
    assert x.shape == (3, 3, 2) and y.shape == (3, 2)
    assert torch.equal(x[0], ds[4][0]) and torch.equal(y[2], ds[7][1])
    x2, y2 = collate(ds, [4, 0, 7])  # a plain list works too
    assert torch.equal(x, x2) and torch.equal(y, y2)
    ex, ey = collate(ds, torch.tensor([], dtype=torch.int64))
    assert ex.shape == (0, 3, 2) and ex.dtype == torch.float32
    assert ey.shape == (0, 2) and ey.dtype == torch.int64


def test_collate_empty_scalar_targets():
    ds = TensorPairDataset(torch.randn(5, 4), torch.arange(5))
    x, y = collate(ds, [])
    assert x.shape == (0, 4) and y.shape == (0,) and y.dtype == torch.int64


@pytest.mark.parametrize("kwargs, words", [
    (dict(global_batch_size=0), ["global_batch_size", "0"]),
    (dict(grad_accum=0), ["grad_accum", "0"]),
    (dict(global_batch_size=4, grad_accum=5), ["grad_accum (5)", "global_batch_size (4)"]),
    (dict(dataset_len=10, global_batch_size=32), ["10 samples", "32", "fix"]),
    (dict(rank=2, world_size=2), ["rank"]),
    (dict(world_size=0, rank=0), ["world_size"]),
])
def test_validation_errors(kwargs, words):
    args = dict(dataset_len=100, global_batch_size=8, seed=0, rank=0, world_size=1, grad_accum=1)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        GlobalBatchSampler(**args)
    for w in words:
        assert w in str(err.value)
