"""hpctrain.Trainer(...).fit(model, DataLoader, loss_fn): a user's model and DataLoader (dict
items, a collate_fn) train the same under zero3 at 2 ranks and fsdp at 3 as in one process;
callbacks see every step; validation every few steps gives the same loss at every world
size; early stopping stops every rank after the same step; what the plan cannot run raises
the same clear exception on every rank. metrics.csv carries the validations at their steps
and the global gradient norm, the same at every world size."""

import pytest
import torch

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

WORKER = "tests/train/fit_api_worker.py"
RUNS = {"single": None, "zero3": 2, "fsdp": 3}  # the worker's case: its world size

# ``WORKER OUT CASE`` in the session's launches (tests/parallel/train_cases.py)
pool(__name__, lambda tmp: [script_step(tmp, name, ranks, WORKER, [], ["{out}", name])
                            for name, ranks in RUNS.items()], "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return {name: script_output(res, name) for name in RUNS}


@pytest.mark.mpi
def test_fit_with_a_dataloader_matches_one_process_and_stops_early_together(runs):
    want = runs["single"]
    assert [s for s, _, _ in want["steps_seen"]] == list(range(1, 13)) and want["ended"] == 12
    assert [loss for _, loss, _ in want["steps_seen"]] == want["losses"]
    # validation every 4 steps over the whole validation set; validate() after fit = the last
    assert [s for s, _ in want["val"]] == [4, 8, 12] and want["val"] == want["val_summary"]
    assert want["after"] == want["val"][-1][1]
    # epochs=4 of 96 samples at the DataLoader's batch of 16: 24 steps, cut after step 5
    assert want["early_ended"] == want["stopped_at"][0] < 24
    # metrics.csv: val_loss only at the validated steps, the global grad norm at every step
    assert [s for s, _, _ in want["csv"]] == list(range(1, 13))
    assert [(s, float(v)) for s, _, v in want["csv"] if v] == \
        [(s, float(f"{v:.8g}")) for s, v in want["val"]]
    norms = [float(n) for _, n, _ in want["csv"]]
    assert all(n > 0 for n in norms)
    for name in ("zero3", "fsdp"):
        ranks, got = RUNS[name], runs[name]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                   rtol=1e-5, atol=0, msg=name)
        assert got["stopped_at"] == [want["stopped_at"][0]] * ranks, (name, got["stopped_at"])
        torch.testing.assert_close(torch.tensor(got["val"]), torch.tensor(want["val"]),
                                   rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(torch.tensor(got["early_losses"]),
                                   torch.tensor(want["early_losses"]), rtol=1e-5, atol=0)
        # rank 0's row holds the norm over every rank's shard: one process's norm
        torch.testing.assert_close(torch.tensor([float(n) for _, n, _ in got["csv"]]),
                                   torch.tensor(norms), rtol=1e-5, atol=0, msg=name)
        assert [s for s, _, v in got["csv"] if v] == [4, 8, 12], name
        # a config error and a model the plan cannot run: the same exception on every rank
        assert got["refused"] == [want["refused"][0]] * ranks, (name, got["refused"])
    (config_kind, config_text), (model_kind, model_text) = want["refused"][0]
    assert config_kind == "ConfigError" and "train.warmup_steps = 10 is more than train.steps" \
        in config_text
    assert model_kind == "SetupError" and model_text.startswith("plan 'domain': ")


def test_bad_input_is_one_clear_error():
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    import hpctrain
    from hpctrain.config import ConfigError

    with pytest.raises(ConfigError, match="unknown option"):
        hpctrain.Trainer(stratgy="zero3")
    with pytest.raises(ConfigError, match="not both"):
        hpctrain.Trainer(hpctrain.Config(), steps=3)
    t = hpctrain.Trainer(steps=2, out_dir="", progress="off")

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(2), torch.zeros(1)

    # an IterableDataset trains (tests/train/test_fit_data.py), but one global batch at least
    with pytest.raises(ConfigError, match="first batch has 1 rows, not its batch_size 2"):
        t._user_model(torch.nn.Linear(2, 1), DataLoader(Stream(), batch_size=2), torch.sub)
    with pytest.raises(ConfigError, match="DataLoader"):
        t._user_model(torch.nn.Linear(2, 1), [1, 2], torch.sub)
    data = TensorDataset(torch.zeros(4, 2), torch.zeros(4, 1))
    with pytest.raises(ConfigError, match="loss_fn"):
        t._user_model(torch.nn.Linear(2, 1), DataLoader(data, batch_size=2), None)
    with pytest.raises(ConfigError, match="the third argument is the validation data"):
        t.fit(torch.nn.Linear(2, 1), DataLoader(data, batch_size=2), torch.sub)
