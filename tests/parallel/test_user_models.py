"""User-shaped models under the strategies at 2 ranks, against one process (fp32, rtol 1e-5),
and the Python API's promises (issues 16 and 22). Two launches in all: the one-process
references, then every 2-rank case in one mpirun (user_models_worker.py).

- ResNet-like (BatchNorm in BasicBlocks held in Sequential stages, in-place ReLU) under zero3
  and ddp WITH activation checkpointing reproduces one process WITHOUT it: losses, parameters
  and buffers (running statistics and num_batches_tracked counted once per step).
- GPT as Sequential(embed, blocks, head) with the head tied to the embedding, split over
  pp=2 (1f1b, interleaved): the tie survives the split.
- GPT with the size auto-wrap policy (min_params=10000) under fsdp and zero3: no unit is made
  of the blocks' ModuleList, so training runs and matches.
- A Sequential ResNet in the pipeline with activation checkpointing keeps its BatchNorm
  statistics as without.
- parallelize(): zero2/zero3 run those stages, a Sequential is accepted by the pipeline,
  full_state_dict() is the one-process state under every strategy, the norms and
  full_state_dict are collective everywhere, a sharded model's state_dict() says what to do
  instead of crashing, and "single" refuses 2 ranks.
"""

import os

import numpy as np
import pytest

from tests.parallel.train_cases import pool, pooled_results, script_output, script_step

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "user_models_worker.py")
RESNET = {"model": "tests.fixtures.resnetish:factory", "optimizer": "sgd", "lr": 0.05,
          "momentum": 0.5}
RESNET_SEQ = {**RESNET, "model": "tests.fixtures.resnetish:factory_sequential"}
TIED = {"model": "tests.fixtures.tied_seq:factory", "optimizer": "adamw", "lr": 0.003,
        "weight_decay": 0.01}
GPT = {"model": "gpt", "optimizer": "adamw", "lr": 0.003}
SIZE_10K = {"auto_wrap_policy": "size", "min_params": 10000}


def _train(cid, ref, train, **tables):
    # The whole final state is compared for the SGD-trained ResNets (their buffers are the
    # point); under AdamW, parameters whose true gradient is zero (a key bias) move by
    # rounding noise, so GPT cases compare losses and the parameter norm, as elsewhere.
    return {"id": cid, "kind": "train", "ref": ref, "state": "resnet" in cid,
            "overrides": {"train": train, **tables}}


REFS = [_train("resnet", None, RESNET), _train("tied", None, TIED), _train("gpt", None, GPT)]
TRAIN = [
    _train("resnet-zero3-ac", "resnet",
           {**RESNET, "strategy": "zero3", "activation_checkpointing": True}),
    _train("resnet-ddp-ac", "resnet",
           {**RESNET, "strategy": "ddp", "activation_checkpointing": True}),
    _train("tied-pp2-1f1b", "tied", {**TIED, "strategy": "pipeline"},
           runtime={"mesh": "pp=2"}),
    _train("tied-pp2-interleaved", "tied", {**TIED, "strategy": "pipeline"},
           runtime={"mesh": "pp=2"}, pipeline={"schedule": "interleaved-1f1b"}),
    _train("gpt-fsdp-size", "gpt", {**GPT, "strategy": "fsdp"}, fsdp=SIZE_10K),
    _train("gpt-zero3-size", "gpt", {**GPT, "strategy": "zero3"}, zero=SIZE_10K),
    # Pipeline BatchNorm sees micro-batches, not the global batch: compared with itself.
    _train("resnetseq-pp2", None, {**RESNET_SEQ, "strategy": "pipeline"},
           runtime={"mesh": "pp=2"}),
    _train("resnetseq-pp2-ac", "resnetseq-pp2",
           {**RESNET_SEQ, "strategy": "pipeline", "activation_checkpointing": True},
           runtime={"mesh": "pp=2"}),
]
AWKWARD_TIED = [["mid1.weight", "mid2.weight"]]
API = [
    {"id": "api-ddp", "strategy": "ddp", "model": "awkward_bn", "tied": AWKWARD_TIED},
    {"id": "api-zero1", "strategy": "zero1", "model": "awkward", "tied": AWKWARD_TIED},
    {"id": "api-zero2", "strategy": "zero2", "model": "awkward", "tied": AWKWARD_TIED},
    {"id": "api-zero3", "strategy": "zero3", "model": "awkward_bn", "tied": AWKWARD_TIED},
    {"id": "api-zero3-opts", "strategy": "zero3", "model": "awkward",
     "zero": {"grad_accum": 1}},
    {"id": "api-fsdp", "strategy": "fsdp", "model": "awkward_bn", "tied": AWKWARD_TIED},
    {"id": "api-pipeline", "strategy": "pipeline", "model": "tied_seq",
     "tied": [["0.tok.weight", "3.out.weight"]]},
    {"id": "api-domain", "strategy": "domain", "model": "conv"},
]
API = [{**c, "kind": "api"} for c in API]
REFUSE = [{"id": "refuse-single", "kind": "refuse", "strategy": "single", "model": "awkward"}]
STAGES = {"api-zero1": 1, "api-zero2": 2, "api-zero3": 3, "api-zero3-opts": 3}
SHARDED = ("api-zero3", "api-zero3-opts", "api-fsdp")


def _steps(tmp):
    """The one-process references and the 2-rank cases, in the session's launches
    (tests/parallel/train_cases.py)."""
    return [script_step(tmp, "single", None, WORKER, REFS, ["{out}", "{cases}"]),
            script_step(tmp, "two", 2, WORKER, TRAIN + API + REFUSE, ["{out}", "{cases}"])]


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return {**script_output(res, "single"), **script_output(res, "two")}


@pytest.mark.parametrize("case", [c for c in TRAIN if c["ref"]], ids=lambda c: c["id"])
def test_trains_as_one_process(results, case):
    got, ref = results[case["id"]], results[case["ref"]]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(got["param_norm"], ref["param_norm"], rtol=1e-5)
    if not case["state"]:
        return
    assert got["state"].keys() == ref["state"].keys()
    for key, value in ref["state"].items():  # parameters AND buffers, counters exactly
        if key.endswith("num_batches_tracked"):
            assert got["state"][key] == value, key
            continue
        # Elements near zero move by rounding noise: tolerance relative to the tensor's scale.
        scale = float(np.abs(value).max()) if value else 0.0
        np.testing.assert_allclose(got["state"][key], value, rtol=1e-5, atol=1e-5 * scale,
                                   err_msg=key)


def test_zero3_makes_a_unit_of_each_resnet_block(results):
    names = [n for n, _ in results["resnet-zero3-ac"]["units"]]
    assert names == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "<root>"]
    sized = [n for n, _ in results["gpt-zero3-size"]["units"]]
    assert "blocks" not in sized and "blocks.0.mlp" in sized


@pytest.mark.parametrize("case", API, ids=lambda c: c["id"])
def test_parallelize_full_state_and_collectives(results, case):
    got = results[case["id"]]
    assert got["keys"], "full_state_dict has the one-process keys, in order"
    assert got["max_rel_err"] < 1e-5
    assert got["int_buffers_equal"] and got["tied_shared"]
    assert got["rank0_only_holders"] == 1
    assert got["param_norm_rel_err"] < 1e-5
    assert all(n > 0 for n in got["collectives"].values()), got["collectives"]
    assert got["stage"] == STAGES.get(case["id"], got["stage"])
    if case["id"] in SHARDED:
        assert got["state_dict"].startswith("RuntimeError") and "full_state_dict" in got["state_dict"]
    else:
        assert got["state_dict"] == "ok"


def test_single_refuses_two_ranks(results):
    got = results["refuse-single"]
    assert got["error"] == "UsageError" and "2 ranks" in got["message"]
