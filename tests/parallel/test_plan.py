"""The ParallelPlan: shorthand strategies, composed meshes and the plans that cannot run
(pure: no torch, no MPI), and the CLI's one line for them."""

import pytest

from hpctrain.config import Config, ConfigError
from hpctrain.parallel.plan import build_plan
from tests.mpirun import run_single


@pytest.mark.parametrize("args, want", [
    (("single", "", 1), ("single", 1, 1, (1,), "ddp", [])),
    (("ddp", "", 4), ("ddp", 1, 4, (1,), "ddp", ["ddp"])),
    (("zero3", "", 4), ("zero3", 1, 4, (1,), "zero3", ["zero3"])),
    (("pipeline", "", 4), ("pipeline", 4, 1, (1,), "ddp", ["pipeline", "ddp"])),
    (("pipeline", "dp=2,pp=2", 4), ("pipeline", 2, 2, (1,), "ddp", ["pipeline", "ddp"])),
    (("domain", "", 4), ("domain", 1, 1, (4,), "ddp", ["domain", "ddp"])),
    (("domain", "dp=2,dom=2", 4), ("domain", 1, 2, (2,), "ddp", ["domain", "ddp"])),
    # composed: a flavour strategy with a mesh, or --mesh with --dp-flavour
    (("zero3", "dom=2,dp=2", 4), ("domain+zero3", 1, 2, (2,), "zero3", ["domain", "zero3"])),
    (("single", "dom=2,dp=2", 4, "fsdp"), ("domain+fsdp", 1, 2, (2,), "fsdp", ["domain", "fsdp"])),
    (("domain", "dom=2,dp=2", 4, "zero1"), ("domain+zero1", 1, 2, (2,), "zero1",
                                            ["domain", "zero1"])),
    (("single", "pp=2,dp=2", 4, "zero2"), ("pipeline+zero2", 2, 2, (1,), "zero2",
                                           ["pipeline", "zero2"])),
    (("single", "", 2, "zero1"), ("zero1", 1, 2, (1,), "zero1", ["zero1"])),
    (("zero3", "pp=2,dp=2", 4), ("pipeline+zero3", 2, 2, (1,), "zero3", ["pipeline", "zero3"])),
    (("single", "pp=2,dp=2", 4, "fsdp"), ("pipeline+fsdp", 2, 2, (1,), "fsdp",
                                          ["pipeline", "fsdp"])),
    # tensor parallel, alone and composed (3D)
    (("tensor", "", 4), ("tensor", 1, 1, (1,), "ddp", ["tensor", "ddp"])),
    (("single", "tp=2,dp=2", 4, "zero3"), ("tensor+zero3", 1, 2, (1,), "zero3",
                                          ["tensor", "zero3"])),
    (("pipeline", "pp=2,tp=2", 4), ("pipeline+tensor", 2, 1, (1,), "ddp",
                                    ["tensor", "pipeline", "ddp"])),
    (("zero1", "pp=2,dp=2,tp=2", 8), ("pipeline+tensor+zero1", 2, 2, (1,), "zero1",
                                      ["tensor", "pipeline", "zero1"])),
])
def test_plans(args, want):
    p = build_plan(*args)
    assert (p.name, p.pp, p.dp, p.dom, p.flavour, p.transforms()) == want
    assert p.world_size == args[2]
    assert p.batch_ranks == p.dp


def test_pipeline_dp_sharding_is_the_pipelines_flavour():
    p = build_plan("pipeline", "pp=2,dp=2", 4, pipeline_dp_sharding="zero2")
    assert p.flavour == "zero2" and p.name == "pipeline"


@pytest.mark.parametrize("args, match", [
    (("single", "", 2), "launcher started 2 ranks"),
    (("zero2", "", 4, "zero3"), "--strategy zero2 and --dp-flavour zero3 name different"),
    (("single", "pp=2,dom=2", 4, "ddp"), "composes with dp only"),
    (("single", "tp=2,dom=2", 4, "ddp"), "composes with dp only"),
    (("tensor", "dom=2,dp=2", 4), "strategy 'tensor' uses tp, dp and pp"),
    (("single", "pp=3", 4, "ddp"), "does not divide 4 ranks"),
    (("zero1", "dp=3", 4), "multiply to 3, not 4"),
    (("pipeline", "dom=2,dp=2", 4), "strategy 'pipeline' uses pp, dp and tp"),
    (("domain", "pp=2,dp=2", 4), "strategy 'domain' uses dom and dp only"),
    (("single", "", 2, "zero4"), "--dp-flavour 'zero4'"),
    (("pipeline", "", 2, "zero3", "zero1"), "disagree"),
])
def test_plans_that_cannot_run(args, match):
    with pytest.raises(ValueError, match=match):
        build_plan(*args)


def test_config_builds_the_plan_and_reads_only_its_tables():
    cfg = Config()
    cfg.train.strategy, cfg.train.model = "zero3", "unet"
    cfg.runtime.mesh = "dom=2,dp=2"
    cfg.train.global_batch_size = 4
    plan = cfg.validate(4).plan(4)
    assert plan.name == "domain+zero3" and cfg.tables_read(plan) == ("domain", "zero")
    cfg.fsdp.sharding_strategy = "NO_SHARD"  # [fsdp] is not read by this plan
    with pytest.raises(ConfigError, match=r"does not read \[fsdp\]"):
        cfg.validate(4)


def test_micro_batches_split_over_dp_only():
    cfg = Config()
    cfg.train.strategy, cfg.train.model = "zero2", "unet"
    cfg.runtime.mesh, cfg.train.global_batch_size = "dom=2,dp=2", 2
    cfg.validate(4)  # 2 samples over 2 replicas: the dom ranks share them
    cfg.runtime.mesh = "dp=4"
    with pytest.raises(ConfigError, match="fewer than the 4 ranks"):
        cfg.validate(4)


def test_a_plan_that_cannot_run_is_one_line_before_mpi(tmp_path):
    proc = run_single(["-m", "hpctrain", "train", "--mesh", "pp=2,dom=2", "--dp-flavour", "fsdp",
                       "--steps", "1", "--out-dir", str(tmp_path)], check=False,
                      env={"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith("hpctrain: error: runtime.mesh = 'pp=2,dom=2': a domain split "
                              "(dom=2) composes with dp only, not with pipeline stages or "
                              "tensor parallel"), err
