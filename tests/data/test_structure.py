"""Structured batches (dict / tuple inputs) and the loss weighting by samples or tokens:
pure helpers, no MPI."""

import pytest
import torch

from hpctrain.data.sampler import CollatedDataset, collate
from hpctrain.data.structure import call_model, check_batch, rows, take_rows, to_device
from hpctrain.train.weighting import LossWeighting


class Keywords(torch.nn.Module):
    def forward(self, input_ids, attention_mask):
        return input_ids * attention_mask


def _items(n=5):
    return [({"input_ids": torch.arange(4) + i, "attention_mask": torch.ones(4, dtype=torch.long)},
             torch.tensor([i, -100, i, -100])) for i in range(n)]


def _collate(items):
    return ({k: torch.stack([x[k] for x, _ in items]) for k in items[0][0]},
            torch.stack([y for _, y in items]))


def test_a_dict_input_is_called_as_keywords_and_split_by_rows():
    data = CollatedDataset(_items(), _collate)
    x, y = collate(data, [1, 3])
    assert rows(x) == 2 and call_model(Keywords(), x).shape == (2, 4)
    assert torch.equal(take_rows(x, 1)["input_ids"], torch.arange(4) + 3)
    assert to_device(x, "cpu")["attention_mask"].dtype == torch.long
    ex, ey = collate(data, [])  # an empty rank's part keeps the structure and dtypes
    assert set(ex) == {"input_ids", "attention_mask"} and rows(ex) == 0 and ey.shape == (0, 4)
    assert data[2][0]["input_ids"].tolist() == [2, 3, 4, 5]


def test_a_collate_fn_that_gives_no_batch_is_one_clear_error():
    bad = CollatedDataset(_items(), lambda items: [x for x, _ in items])
    with pytest.raises(TypeError, match="not an \\(inputs, targets\\) pair"):
        collate(bad, [0, 1, 2])
    ragged = CollatedDataset(_items(), lambda items: (torch.zeros(3), torch.zeros(2)))
    with pytest.raises(TypeError, match="different numbers of rows"):
        collate(ragged, [0, 1, 2])
    assert check_batch((torch.zeros(2, 3), {"a": torch.zeros(2)})) is None


def test_tokens_weighting_counts_what_the_loss_averages():
    y = torch.tensor([[1, -100, 2], [-100, -100, -100]])
    samples, tokens = LossWeighting("samples"), LossWeighting("tokens", -100)
    assert samples.count(y) == 2 and tokens.count(y) == 2 and tokens.count(y[1:]) == 0
    assert tokens.count({"labels": y}) == 2
    loss = tokens.wrap(lambda out, t: torch.nn.functional.cross_entropy(out, t.reshape(-1)))
    out = torch.randn(3, 4, requires_grad=True)
    zero = loss(out, y[1])  # no valid token: 0, not NaN, still a function of the output
    zero.backward()
    assert zero.item() == 0.0 and out.grad is not None
    assert tokens.weights([2, 0, 6], 8.0) == [0.25, 0.0, 0.75]


def test_a_loss_declares_what_it_counts():
    """Hugging Face style labels (the inputs, shifted inside the loss) count from the second
    label of each row: the loss says so (count_units), and the weights follow it."""
    from hpctrain.train.weighting import shifted_count

    y = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    tokens = LossWeighting("tokens", -100)

    def shifted(out, t):
        return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                                                 t[:, 1:].reshape(-1))
    assert tokens.counter(shifted)(y) == 5  # every valid label: not what it averages
    shifted.count_units = shifted_count()
    assert tokens.counter(shifted)(y) == 3 and tokens.counter(shifted)({"labels": y}) == 3
    assert tokens.wrap(shifted).count_units(y[1:]) == 1
    assert LossWeighting("samples").counter(shifted)(y) == 2  # samples: rows, as before
    shifted.count_units = 3
    with pytest.raises(TypeError, match="count_units is a int"):
        tokens.counter(shifted)


def test_worker_processes_read_dict_batches_and_empty_parts_keep_the_keys():
    from torch.utils.data import DataLoader

    from hpctrain.data.loader import WorkerEval, WorkerReader
    from hpctrain.data.sampler import GlobalBatchSampler

    class Par:
        def load_batch(self, dataset, indices):
            return collate(dataset, indices)

    items = _items(10)
    loader = DataLoader(items, batch_size=4, collate_fn=_collate, num_workers=2,
                        multiprocessing_context="fork")
    reader = WorkerReader(loader, GlobalBatchSampler(10, 4, 3, 0, 2), 2, Par())
    (x, y, n), = reader.micro_batches(0)
    reader.close()
    assert n == 2 and set(x) == {"input_ids", "attention_mask"} and rows(x) == 2
    parts = list(WorkerEval(loader, 4).parts(2, 3, Par()))  # rank 2 of 3: last part empty
    assert rows(parts[-1][0]) == 0 and set(parts[-1][0]) == {"input_ids", "attention_mask"}
