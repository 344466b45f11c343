"""Units, wrap policies, flat buffers and options of the sharded strategies (and the
strategy name checks of parallel.wrap), without MPI."""

from types import SimpleNamespace

import pytest
import torch

from hpctrain import parallel
from hpctrain.config import load_config
from hpctrain.errors import UsageError
from hpctrain.models.gpt import GPT
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.fsdp import FSDPOptions
from hpctrain.parallel.single import wrap as single_wrap
from hpctrain.parallel.units import partition, partition_modules, wrapped_modules
from hpctrain.parallel.zero import ZeroOptions, options_for
from hpctrain.parallel.zero import wrap as zero_wrap
from hpctrain.train.plan_options import strategy_options
from tests.fixtures import resnetish, vitish
from tests.fixtures.awkward import AwkwardNet


class _FakeComm:
    """Rank/size only: FlatUnit's constructor does not communicate."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_gpt_units_are_blocks_plus_a_root_holding_the_tied_embedding():
    units, frozen = partition(GPT(layers=3))
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    root = dict(units[-1].params)
    assert "tok_emb.weight" in root and "head.weight" not in root  # tied: once
    assert not frozen


def test_awkward_units_keep_frozen_params_out_and_tied_ones_once():
    units, frozen = partition(AwkwardNet())
    names = [n for n, _ in units[0].params]
    assert [n for n, _ in frozen] == ["gain"]
    assert "mid1.weight" in names and "mid2.weight" not in names and "unused" in names
    assert sum(p.numel() for _, p in units[0].params) == 232 + 870 + 29 + 150 + 77


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_flat_unit_pads_any_count_and_params_view_it(size):
    model = AwkwardNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    units, _ = partition(model)
    shards = []
    for rank in range(size):
        m = AwkwardNet()
        m.load_state_dict(model.state_dict())
        (spec,), _ = partition(m)
        u = FlatUnit("root", spec.params, _FakeComm(rank, size), keep_full=True)
        assert u.padded % size == 0 and u.padded - u.numel < size
        assert u.shard.data_ptr() == u.full.data_ptr() + u.lo * 4  # zero1/2: a view
        shards.append(u.shard.detach().clone())
        for name, p in m.named_parameters():
            if p.requires_grad:
                assert p.data_ptr() >= u.full.data_ptr()  # a view of the buffer
                torch.testing.assert_close(p.detach(), before[name])
    flat = torch.cat(shards)
    assert torch.count_nonzero(flat[u.numel:]) == 0  # padding is zero


def test_flat_unit_owned_ranges_cover_each_parameter_once():
    size = 3
    covered = {}
    for rank in range(size):
        (spec,), _ = partition(AwkwardNet())
        u = FlatUnit("root", spec.params, _FakeComm(rank, size), keep_full=False)
        for s in u.slots:
            (a, b), view = u.shard_view(s)
            assert view.numel() == b - a
            covered[s.name] = covered.get(s.name, 0) + (b - a)
    assert covered == {s.name: s.numel for s in u.slots}


def test_zero_options_are_checked_and_built_from_the_config():
    with pytest.raises(ValueError, match="expected 1, 2 or 3"):
        ZeroOptions(stage=4)
    with pytest.raises(ValueError, match="grad_accum"):
        ZeroOptions(grad_accum=0)
    with pytest.raises(ValueError, match="wrap_classes"):
        ZeroOptions(auto_wrap_policy="class")
    with pytest.raises(ValueError, match="min_params"):
        ZeroOptions(auto_wrap_policy="size")
    cfg = load_config(None, [{"train": {"strategy": "zero2", "grad_accum": 2},
                              "zero": {"sync_batchnorm": False}}])
    assert strategy_options(cfg) == ZeroOptions(stage=2, grad_accum=2, sync_batchnorm=False)
    cfg = load_config(None, [{"train": {"strategy": "zero3"},
                              "zero": {"auto_wrap_policy": "class",
                                       "wrap_classes": "BasicBlock, Block"}}])
    assert strategy_options(cfg) == ZeroOptions(stage=3, auto_wrap_policy="class",
                                                 wrap_classes=("BasicBlock", "Block"))


def test_the_strategy_name_gives_the_stage_and_options_must_not_contradict_it():
    assert options_for("zero3", None) == ZeroOptions(stage=3)
    assert options_for("zero2", ZeroOptions(grad_accum=2)) == ZeroOptions(stage=2, grad_accum=2)
    assert options_for("zero1", ZeroOptions(stage=1)) == ZeroOptions(stage=1)
    with pytest.raises(ValueError, match="ZeroOptions\\(stage=3\\)"):
        options_for("zero3", ZeroOptions(stage=1))
    with pytest.raises(TypeError, match="ZeroOptions"):
        options_for("zero2", FSDPOptions())
    with pytest.raises(ValueError, match="needs the stage"):
        zero_wrap(torch.nn.Linear(2, 2), None, None, ZeroOptions())
    # parallelize() goes through parallel.wrap: refused before the world is touched.
    with pytest.raises(ValueError, match="different stages"):
        parallel.wrap("zero3", torch.nn.Linear(2, 2), None, None, ZeroOptions(stage=1))


def test_single_refuses_a_world_of_several_ranks():
    world = SimpleNamespace(size=2, device=torch.device("cpu"))
    with pytest.raises(UsageError, match="strategy 'single' on 2 ranks.*ddp"):
        single_wrap(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), world)


def _unit_names(model, **policy):
    units, _ = partition_modules(model, wrapped_modules(model, ZeroOptions(stage=3, **policy)))
    return [u.name for u in units]


def test_blocks_in_sequential_stages_are_units_as_modulelist_elements_are():
    # torchvision ResNet's BasicBlocks in layer1..4 and timm ViT's blocks: one unit each, not
    # one root unit holding the whole model.
    assert _unit_names(resnetish.ResNetish()) == resnetish.BLOCKS + ["<root>"]
    assert _unit_names(vitish.ViTish()) == [f"blocks.{i}" for i in range(vitish.DEPTH)] + ["<root>"]
    assert _unit_names(resnetish.ResNetish(), auto_wrap_policy="class",
                       wrap_classes=("BasicBlock",)) == resnetish.BLOCKS + ["<root>"]
    assert _unit_names(vitish.ViTish(), auto_wrap_policy="none") == ["<root>"]


def test_no_policy_makes_a_unit_of_a_container():
    # GPT blocks hold 28272 params: each MLP (18672) is wrapped, each block's rest (9600)
    # is not; the ModuleList holding both rests (19200) has no forward and must not be a unit.
    wrapped = [n for n, _ in wrapped_modules(GPT(), ZeroOptions(auto_wrap_policy="size",
                                                                min_params=10000))]
    assert wrapped == ["blocks.0.mlp", "blocks.1.mlp"]
    with pytest.raises(UsageError, match="ModuleList.*containers"):
        wrapped_modules(GPT(), ZeroOptions(auto_wrap_policy="class", wrap_classes=("ModuleList",)))
