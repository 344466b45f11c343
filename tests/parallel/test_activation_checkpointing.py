"""Activation checkpointing wraps blocks only, recomputes without touching BatchNorm
statistics, and turns a Hugging Face model's KV cache off."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from hpctrain.parallel.activation_checkpointing import checkpoint_blocks
from tests.fixtures import resnetish


def _train(model, dataset, loss_fn, steps=3, batch=16):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    losses = []
    for step in range(steps):
        x, y = dataset[step * batch:(step + 1) * batch]
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("make", [resnetish.factory, resnetish.factory_sequential])
def test_batchnorm_blocks_with_inplace_relu_train_as_without_checkpointing(make):
    torch.manual_seed(0)
    model, data, loss_fn = make()
    ac = copy.deepcopy(model)
    assert checkpoint_blocks(ac, is_main=False) == 4
    ref_losses, losses = _train(model, data, loss_fn), _train(ac, data, loss_fn)
    assert losses == ref_losses
    ref, got = dict(model.named_buffers()), dict(ac.named_buffers())
    assert ref.keys() == got.keys()
    for name, buf in ref.items():
        torch.testing.assert_close(got[name], buf, rtol=0, atol=0, msg=name)
    counts = {int(v) for k, v in got.items() if k.endswith("num_batches_tracked")}
    assert counts == {3}  # one per step, not two


def test_only_blocks_are_wrapped_and_a_model_without_blocks_is_told(capsys):
    model = resnetish.ResNetish()
    checkpoint_blocks(model, is_main=True)
    wrapped = {n for n, m in model.named_modules() if getattr(m, "_hpctrain_checkpointed", False)}
    assert wrapped == set(resnetish.BLOCKS)  # not bn1, not the in-place relu
    assert capsys.readouterr().out == ""
    assert checkpoint_blocks(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), is_main=True) == 0
    assert "found no blocks" in capsys.readouterr().out


class _FakeHFDecoder(nn.Module):
    """The shape of an HF decoder: config.use_cache and layers in a ModuleList; with the cache
    on, every layer forward appends to it (as past_key_values grow)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.cache = []

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if self.config.use_cache:
                self.cache.append(x.detach())
        return x


@pytest.mark.parametrize("is_main", [True, False])
def test_kv_cache_is_turned_off_with_one_line_on_rank_0(capsys, is_main):
    model = _FakeHFDecoder()
    assert checkpoint_blocks(model, is_main=is_main) == 2
    assert model.config.use_cache is False
    out = capsys.readouterr().out
    assert out.count("use_cache = False") == (1 if is_main else 0)
    model(torch.randn(3, 4)).sum().backward()
    assert model.cache == []  # neither the forward nor the recompute extended it
