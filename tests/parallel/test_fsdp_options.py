"""fsdp options, config validation and auto-wrap policies, without MPI; memory under mpirun."""

import os

import pytest
from torch import nn

from hpctrain.config import ConfigError, load_config
from hpctrain.models.gpt import GPT
from hpctrain.parallel.fsdp import FSDPOptions, wrapped_modules
from hpctrain.parallel.units import partition_modules
from hpctrain.train.plan_options import strategy_options
from tests.fixtures.awkward import AwkwardNet
from tests.parallel.train_cases import pool, pooled_results

HERE = os.path.dirname(os.path.abspath(__file__))


def test_options_are_checked():
    with pytest.raises(ValueError, match="sharding_strategy"):
        FSDPOptions(sharding_strategy="FULL")
    with pytest.raises(ValueError, match="wrap_classes"):
        FSDPOptions(auto_wrap_policy="class")
    with pytest.raises(ValueError, match="min_params"):
        FSDPOptions(auto_wrap_policy="size")
    with pytest.raises(ValueError, match="param_dtype"):
        FSDPOptions(param_dtype="float8")
    with pytest.raises(ValueError, match="grad_accum"):
        FSDPOptions(grad_accum=0)


def test_bucket_sizes_are_checked_naming_the_option():
    from hpctrain.parallel.zero import ZeroOptions

    for make, key in ((lambda v: ZeroOptions(stage=2, reduce_bucket_size=v), "ZeroOptions.reduce"),
                      (lambda v: FSDPOptions(reduce_bucket_size=v), "FSDPOptions.reduce"),
                      (lambda v: FSDPOptions(allgather_bucket_size=v), "FSDPOptions.allgather")):
        for bad in (0, -1, 1.5, True, "16MB"):
            with pytest.raises(ValueError, match=f"{key}_bucket_size = "):
                make(bad)
        assert make(1) is not None  # one byte: pieces of one element per rank


def test_config_builds_options_and_rejects_bad_tables():
    cfg = load_config(None, [{"train": {"strategy": "fsdp", "grad_accum": 2},
                              "fsdp": {"sharding_strategy": "HYBRID_SHARD",
                                       "auto_wrap_policy": "class",
                                       "wrap_classes": "GPTBlock, MLPBlock",
                                       "param_dtype": "bf16", "cpu_offload": True,
                                       "reduce_bucket_size": 4096,
                                       "allgather_bucket_size": 1 << 20}}])
    assert strategy_options(cfg.validate(2)) == FSDPOptions(
        sharding_strategy="HYBRID_SHARD", auto_wrap_policy="class",
        wrap_classes=("GPTBlock", "MLPBlock"), param_dtype="bf16", cpu_offload=True, grad_accum=2,
        reduce_bucket_size=4096, allgather_bucket_size=1 << 20)
    bad = [({"sharding_strategy": "HALF"}, 2, "fsdp.sharding_strategy"),
           ({"auto_wrap_policy": "class"}, 2, "wrap_classes"),
           ({"auto_wrap_policy": "size"}, 2, "min_params"),
           ({"param_dtype": "fp8"}, 2, "fsdp.param_dtype")]
    for table, n, match in bad:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [{"train": {"strategy": "fsdp", "global_batch_size": 8},
                                "fsdp": table}]).validate(n)
    with pytest.raises(ConfigError, match="divisible"):
        load_config(None, [{"train": {"strategy": "fsdp", "global_batch_size": 8},
                            "fsdp": {"sharding_strategy": "HYBRID_SHARD"},
                            "runtime": {"ranks_per_node": 2}}]).validate(3)


def test_wrap_by_class_names_unknown_classes():
    with pytest.raises(ValueError, match="match no module"):
        wrapped_modules(GPT(), FSDPOptions(auto_wrap_policy="class", wrap_classes=("Block",)))


def test_size_policy_is_bottom_up_and_units_keep_ties_frozen_and_unused_right():
    # AwkwardNet: mid1.weight is tied into mid2; gain is frozen; unused never gets a grad.
    model = AwkwardNet()
    wrapped = wrapped_modules(model, FSDPOptions(auto_wrap_policy="size", min_params=150))
    assert [n for n, _ in wrapped] == ["inp", "mid1", "out"]  # mid2: its bias only (29)
    units, frozen = partition_modules(model, wrapped)
    names = {u.name: [n for n, _ in u.params] for u in units}
    assert names["mid1"] == ["mid1.bias"]  # the tied weight is shared with mid2: root
    assert "mid1.weight" in names["<root>"] and "unused" in names["<root>"]
    assert [n for n, _ in frozen] == ["gain"]
    assert wrapped_modules(nn.Linear(3, 3), FSDPOptions(auto_wrap_policy="none")) == []


# The memory worker runs in the session's launches (tests/parallel/train_cases.py); at 4
# ranks in one that pretends two nodes of 2 ranks (HYBRID_SHARD), as 2 ranks on one host are.
RANKS = (2, 4)
pool(__name__, lambda tmp: [
    {"id": f"n{n}", "world": n, "script": os.path.join(HERE, "fsdp_memory_worker.py"),
     **({"launch_env": {"HPCTRAIN_RANKS_PER_NODE": "2"}} if n > 2 else {})} for n in RANKS],
    "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.mpi
@pytest.mark.parametrize("n", RANKS)
def test_memory_matches_the_formulas(runs, n):
    r = runs[f"n{n}"]  # the worker's assertions abort its launch
    assert r["rc"] == 0 and "fsdp memory ok 0" in r["stderr"], r


class _FakeComm:
    """Rank/size only: FlatUnit's constructor does not communicate."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_mixed_precision_unit_computes_in_bf16_and_keeps_an_fp32_master_shard():
    import torch

    from hpctrain.parallel.flat_buffer import FlatUnit

    model = nn.Linear(5, 3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    u = FlatUnit("root", list(model.named_parameters()), _FakeComm(1, 2), keep_full=False,
                 compute_dtype=torch.bfloat16)
    assert u.full.dtype == torch.bfloat16 and model.weight.dtype == torch.bfloat16
    assert u.shard.dtype == torch.float32 and u.shard.numel() == 9  # 18 elements / 2
    flat = torch.cat([before["weight"].reshape(-1), before["bias"]])
    torch.testing.assert_close(u.shard.detach(), flat[9:18])  # exact fp32 values, not rounded
    # it starts freed (building unit after unit never holds the whole model); its first
    # gather fills the bf16 parameters
    assert not u.gathered and u.full.untyped_storage().nbytes() == 0
    assert u.full_bytes() == 18 * 2
    with pytest.raises(ValueError, match="keep_full"):
        FlatUnit("root", list(nn.Linear(2, 2).named_parameters()), _FakeComm(0, 2),
                 keep_full=True, compute_dtype=torch.bfloat16)
