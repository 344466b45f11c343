"""fsdp at 2 and 4 ranks reproduces single-process training (fp32, rtol 1e-5): every sharding
strategy x built-in models + the awkward fixture x sgd/adamw, auto-wrap by class and by size
(with the units they form checked), clipping, grad accumulation, and bf16 params loosely.

The worker runs all the cases of a world size in the session's launches (startup is paid
once; tests/parallel/train_cases.py)."""

import os

import pytest

from tests.parallel.equivalence import (Case, assert_case, assert_matches, summary,
                                        worker_results, worker_steps)
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp_worker.py")
ARGS = ["{out}", "{cases}"]  # fsdp_worker.py OUT CASES
SPEC = {"mlp": "mlp", "gpt": "gpt", "awkward": "tests.fixtures.awkward:factory",
        "awkward_bn": "tests.fixtures.awkward:factory_batchnorm"}
LR = {("mlp", "sgd"): 0.1, ("gpt", "sgd"): 0.3, ("awkward", "sgd"): 0.3}
MODELS, OPTIMIZERS = ("mlp", "gpt", "awkward"), ("sgd", "adamw")
SHARDINGS = {2: ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
             4: ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")}
ACCUM = {2: 1, 4: 2}  # 4 ranks also accumulate: micro-batches of 7 split 2,2,2,1


def _train(model, opt, accum, clip=0.0):
    lr = LR.get((model.removesuffix("_bn"), opt), 0.003)
    return {"model": SPEC[model], "optimizer": opt, "lr": lr, "grad_accum": accum,
            "max_grad_norm": clip}


def _ref_key(model, opt, accum, clip=0.0):
    return f"single-{model}-{opt}-{accum}-{clip}"


# (id, world, train table, fsdp table, reference key or None for loose checks)
CASES = []
for n, shardings in SHARDINGS.items():
    for sh in shardings:
        for model in MODELS:
            for opt in OPTIMIZERS:
                CASES.append((f"{sh}-{model}-{opt}-x{n}", n, _train(model, opt, ACCUM[n]),
                              {"sharding_strategy": sh}, _ref_key(model, opt, ACCUM[n])))
CASES += [
    # Synchronized BatchNorm buffers under sharding.
    ("FULL_SHARD-awkward_bn-adamw-x4", 4, _train("awkward_bn", "adamw", 2),
     {"sharding_strategy": "FULL_SHARD"}, _ref_key("awkward_bn", "adamw", 2)),
    ("HYBRID_SHARD-awkward_bn-sgd-x4", 4, _train("awkward_bn", "sgd", 2),
     {"sharding_strategy": "HYBRID_SHARD"}, _ref_key("awkward_bn", "sgd", 2)),
    # Clipping by the global norm over shards (and over replicas for HYBRID).
    ("clip-FULL_SHARD-gpt-x4", 4, _train("gpt", "adamw", 2, 0.5),
     {"sharding_strategy": "FULL_SHARD"}, _ref_key("gpt", "adamw", 2, 0.5)),
    ("clip-HYBRID_SHARD-gpt-x4", 4, _train("gpt", "adamw", 2, 0.5),
     {"sharding_strategy": "HYBRID_SHARD"}, _ref_key("gpt", "adamw", 2, 0.5)),
    ("clip-NO_SHARD-gpt-x2", 2, _train("gpt", "adamw", 1, 0.5),
     {"sharding_strategy": "NO_SHARD"}, _ref_key("gpt", "adamw", 1, 0.5)),
    # Auto-wrap by class (nested: Linear units inside GPTBlock units) and by size.
    ("wrap-class-gpt-x2", 2, _train("gpt", "adamw", 1),
     {"auto_wrap_policy": "class", "wrap_classes": "GPTBlock"}, _ref_key("gpt", "adamw", 1)),
    ("wrap-nested-gpt-x4", 4, _train("gpt", "adamw", 2),
     {"auto_wrap_policy": "class", "wrap_classes": "GPTBlock,Linear"}, _ref_key("gpt", "adamw", 2)),
    ("wrap-size-gpt-x4", 4, _train("gpt", "sgd", 2),
     {"auto_wrap_policy": "size", "min_params": 9000}, _ref_key("gpt", "sgd", 2)),
    ("wrap-none-SHARD_GRAD_OP-gpt-x2", 2, _train("gpt", "sgd", 1),
     {"auto_wrap_policy": "none", "sharding_strategy": "SHARD_GRAD_OP"}, _ref_key("gpt", "sgd", 1)),
    ("no-prefetch-gpt-x4", 4, _train("gpt", "adamw", 2),
     {"backward_prefetch": "NONE"}, _ref_key("gpt", "adamw", 2)),
    # Recomputed block forwards run inside backward, after the block was re-gathered.
    ("ac-FULL_SHARD-gpt-x2", 2, {**_train("gpt", "adamw", 1), "activation_checkpointing": True},
     {"sharding_strategy": "FULL_SHARD"}, _ref_key("gpt", "adamw", 1)),
    # Mixed precision: bf16 compute params, fp32 master shards (loose: compared below);
    # fp16 autocast with loss scaling agreed over shards.
    ("fp16-autocast-HYBRID_SHARD-gpt-x4", 4, {**_train("gpt", "adamw", 2), "precision": "fp16"},
     {"sharding_strategy": "HYBRID_SHARD"}, None),
    ("bf16-FULL_SHARD-gpt-x2", 2, _train("gpt", "adamw", 1),
     {"param_dtype": "bf16", "reduce_dtype": "fp32"}, None),
    ("bf16-HYBRID_SHARD-gpt-x4", 4, _train("gpt", "adamw", 2),
     {"param_dtype": "bf16", "sharding_strategy": "HYBRID_SHARD"}, None),
    ("bf16-NO_SHARD-mlp-x2", 2, _train("mlp", "adamw", 1),
     {"param_dtype": "bf16", "sharding_strategy": "NO_SHARD"}, None),
]
LOOSE_REF = {"fp16-autocast-HYBRID_SHARD-gpt-x4": _ref_key("gpt", "adamw", 2),
             "bf16-FULL_SHARD-gpt-x2": _ref_key("gpt", "adamw", 1),
             "bf16-HYBRID_SHARD-gpt-x4": _ref_key("gpt", "adamw", 2),
             "bf16-NO_SHARD-mlp-x2": _ref_key("mlp", "adamw", 1)}


def _ref_row(k):
    _, model, opt, accum, clip = k.split("-")
    return Case(k, None, {"overrides": {"train": _train(model, opt, int(accum), float(clip))}})


# The equivalence table: the one-process references, then every case (2 ranks, then 4).
TABLE = ([_ref_row(k) for k in sorted({k for *_, k in CASES if k} | set(LOOSE_REF.values()))]
         + [Case(i, w, {"overrides": {"train": {**t, "strategy": "fsdp"}, "fsdp": f}}, ref=k,
                 strategy="fsdp") for i, w, t, f, k in CASES])
ROWS = {r.id: r for r in TABLE}

# 2 ranks per pretend node at 4: HYBRID_SHARD shards over 2, replicates x2 (at 2 ranks
# that is the one node they have anyway)
pool(__name__, lambda tmp: worker_steps(tmp, WORKER, TABLE, ARGS,
                                        launch_env={4: {"HPCTRAIN_RANKS_PER_NODE": "2"}}))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results(pooled_results(__name__, tmp_path_factory), TABLE)


@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=lambda c: c[0])
def test_fsdp_matches_single(results, case):
    assert_case(results, ROWS[case[0]])


@pytest.mark.parametrize("cid", sorted(LOOSE_REF))
def test_low_precision_tracks_fp32(results, cid):
    got, ref = summary(results, cid), summary(results, LOOSE_REF[cid])
    assert got["losses"] != ref["losses"]  # low-precision arithmetic really happened
    assert_matches(got, ref, keys=("losses",), rtol=5e-2, name=cid)
    assert got["losses"][-1] < got["losses"][0] - 0.3  # and it still learns
    assert_matches(got, ref, keys=("param_norm",), rtol=2e-2, name=cid)


GPT_BLOCK_NUMEL = 2 * 48 + (48 * 144 + 144) + (48 * 48 + 48) + 2 * 48 + (48 * 192 + 192) \
    + (192 * 48 + 48)
GPT_ROOT_NUMEL = 67 * 48 + 32 * 48 + 2 * 48  # tok_emb (tied with head), pos_emb, ln_f


def test_units_formed_by_each_policy(results):
    default = dict(results["FULL_SHARD-gpt-adamw-x2"]["units"])
    assert default == {"blocks.0": GPT_BLOCK_NUMEL, "blocks.1": GPT_BLOCK_NUMEL,
                       "<root>": GPT_ROOT_NUMEL}
    assert dict(results["wrap-class-gpt-x2"]["units"]) == default
    # Nested: each Linear is its own unit inside its block; the tied head joins the root.
    nested = [n for n, _ in results["wrap-nested-gpt-x4"]["units"]]
    assert nested == ["blocks.0", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0",
                      "blocks.0.mlp.2", "blocks.1", "blocks.1.attn.qkv", "blocks.1.attn.proj",
                      "blocks.1.mlp.0", "blocks.1.mlp.2", "<root>"]
    assert dict(results["wrap-nested-gpt-x4"]["units"])["blocks.0"] == 4 * 48  # the LayerNorms
    # Size >= 9000, bottom-up: attn (9408) and each MLP Linear (9408, 9264); LayerNorms left.
    size = dict(results["wrap-size-gpt-x4"]["units"])
    assert size == {"blocks.0.attn": 9408, "blocks.0.mlp.0": 9408, "blocks.0.mlp.2": 9264,
                    "blocks.1.attn": 9408, "blocks.1.mlp.0": 9408, "blocks.1.mlp.2": 9264,
                    "<root>": GPT_ROOT_NUMEL + 2 * 4 * 48}
    assert [n for n, _ in results["wrap-none-SHARD_GRAD_OP-gpt-x2"]["units"]] == ["<root>"]
