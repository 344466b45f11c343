"""Any torch DataLoader through hpctrain.Trainer.fit (issue 21): map-style data read by the
loader's workers (a collate_fn, zero3, the domain split's crop) and IterableDatasets (with
and without workers, a second pass, a resume that re-reads the stream) give one process's
losses and validation losses at 2 ranks; the readers (hpctrain/data/loader.py) on their
own; what cannot work is one clear ConfigError."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

WORKER = "tests/train/fit_data_worker.py"
CASES = ["map-workers", "stream", "stream-workers", "domain-workers"]

# ``WORKER OUT CASE...`` at 1 and 2 ranks in the session's launches
# (tests/parallel/train_cases.py)
pool(__name__, lambda tmp: [
    script_step(tmp, "single", None, WORKER, [], ["{out}", *[f"single:{c}" for c in CASES]]),
    script_step(tmp, "two", 2, WORKER, [], ["{out}", *CASES])], "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return script_output(res, "single"), script_output(res, "two")


@pytest.mark.mpi
def test_any_dataloader_matches_one_process(runs):
    want, got = runs
    for case in CASES:
        torch.testing.assert_close(torch.tensor(got[case]), torch.tensor(want[f"single:{case}"]),
                                   rtol=1e-5, atol=0, msg=case)
    assert len(want["single:stream"]) == 10 + 3  # epochs=2: 10 steps (two passes of 5)


class _Par:
    """A strategy's read that records what it was given (a domain executor would crop)."""

    def __init__(self):
        self.reads = []

    def load_batch(self, dataset, indices):
        from hpctrain.data.sampler import collate

        self.reads.append(len(indices))
        return collate(dataset, indices)


class _Dicts(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.x[i, :1]}


def _collate(items):
    assert items, "the collate_fn got []"
    return torch.stack([i["x"] for i in items]), torch.stack([i["y"] for i in items])


def test_worker_reader_reads_each_part_in_order_and_shuts_down():
    from hpctrain.data.loader import WorkerEval, WorkerReader
    from hpctrain.data.sampler import GlobalBatchSampler

    data = _Dicts(10)
    loader = DataLoader(data, batch_size=5, collate_fn=_collate, num_workers=2,
                        multiprocessing_context="fork")
    # 5 samples, 3 micro-batches (2, 2, 1 samples) over 2 ranks: rank 1's third is empty
    sampler = GlobalBatchSampler(10, 5, 7, 1, 2, grad_accum=3)
    par = _Par()
    reader = WorkerReader(loader, sampler, 4, par)
    for step in (1, 2, 0):  # a resumed run starts at step 1; a step out of order reopens
        got = list(reader.micro_batches(step))
        want = [m for m in sampler.micro_batches(step) if len(m)]
        assert [n for _, _, n in got] == [len(m) for m in want] == [1, 1]
        for (x, y, _), m in zip(got, want):
            assert torch.equal(x, data.x[m]) and torch.equal(y, data.x[m, :1])
    workers = reader._it._it._workers
    reader.close()
    assert reader._it is None and not any(w.is_alive() for w in workers)
    # validation: 10 samples in batches of 4 over 3 ranks; rank 2's part of the last is empty
    source = WorkerEval(loader, 4)
    parts = list(source.parts(2, 3, par))
    assert [(k, rows) for _, _, k, rows in parts] == [(1, 4), (1, 4), (0, 2)]
    assert parts[-1][0].shape == (0, 3) and parts[-1][1].shape == (0, 1)
    assert torch.equal(parts[0][0], data.x[[2]])
    source.close()


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, every = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, every):
            yield torch.full((2,), float(i)), torch.tensor([float(i)])


def test_stream_reader_drops_short_batches_repeats_passes_and_resumes():
    from hpctrain.data.loader import FullBatches, StreamReader
    from hpctrain.data.sampler import GlobalBatchSampler

    loader = DataLoader(_Stream(10), batch_size=4)  # 4, 4, 2 (dropped), then a new pass
    batches = FullBatches(loader, 4)
    firsts = [float(next(batches)[0][0, 0]) for _ in range(5)]
    assert firsts == [0, 4, 0, 4, 0]
    sampler = GlobalBatchSampler(4, 4, 0, 0, 2, grad_accum=2)  # rank 0 of 2: rows 0 and 2
    reader = StreamReader(loader, sampler, _Par())
    got = [[float(x[0, 0]) for x, _, _ in reader.micro_batches(s)] for s in (3, 4)]
    assert got == [[4, 6], [0, 2]]  # step 3 = the second batch of the second pass
    reader.close()
    with pytest.raises(ValueError, match="no batch of 4 rows"):
        next(FullBatches(DataLoader(_Stream(3), batch_size=4), 4))


def test_what_cannot_work_is_one_clear_error():
    import hpctrain
    from hpctrain.config import ConfigError

    t = hpctrain.Trainer(steps=2, out_dir="", progress="off")
    net, data = torch.nn.Linear(2, 1), TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1))
    with pytest.raises(ConfigError, match="batch_size=None"):
        t._user_model(net, DataLoader(data, batch_size=None), torch.sub)
    with pytest.raises(ConfigError, match="batch_sampler"):
        t._user_model(net, DataLoader(data, batch_sampler=[[0, 1], [2]]), torch.sub)
    with pytest.raises(ConfigError, match="first batch has 3 rows"):
        t._user_model(net, DataLoader(_Stream(3), batch_size=4), torch.sub)
    with pytest.raises(ConfigError, match="global_batch_size"):
        hpctrain.Trainer(steps=2, global_batch_size=8)._user_model(
            net, DataLoader(_Stream(9), batch_size=4), torch.sub)
    with pytest.raises(ConfigError, match="needs len"):
        hpctrain.Trainer(epochs=2)._user_model(net, DataLoader(_Stream(9), batch_size=4),
                                               torch.sub)
    built = t._user_model(net, DataLoader(_Stream(9), batch_size=4), torch.sub)
    assert t.cfg.train.global_batch_size == 4 and built.dataset[1][1].item() == 1.0


def test_validating_on_the_training_stream_leaves_its_open_pass_alone():
    # the same loader for training and validation, persistent workers: validation iterates
    # a copy, so the pass training has open goes on where it was
    from hpctrain.data.loader import StreamEval
    from hpctrain.data.sampler import collate

    class Stream(IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            for i in range(info.id, 12, info.num_workers):
                yield torch.tensor([float(i)]), torch.tensor([float(i)])

    class Par:
        def load_batch(self, dataset, indices):
            return collate(dataset, indices)

    loader = DataLoader(Stream(), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork")
    training = iter(loader)
    first = next(training)[0].flatten().tolist()
    validation = StreamEval(loader)
    assert sum(n for *_, n, _ in validation.parts(0, 1, Par())) == 12
    validation.close()
    assert (first, next(training)[0].flatten().tolist()) == ([0.0, 2.0], [1.0, 3.0])
    del training
