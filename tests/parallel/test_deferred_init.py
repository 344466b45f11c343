"""Deferred initialisation (parallel/deferred.py): a model whose full fp32 size is above a
per-rank memory cap trains under zero3 at 4 ranks, with single's losses; the same job with
deferred init off dies at the cap (the control: the cap bites). Plus the exactness of the
placeholders' values, without MPI.

The cap is RLIMIT_DATA (private writable memory, where every tensor lives), set after MPI
and torch's meta-device code are loaded (tests/parallel/capped_train_worker.py).
"""

import json
import subprocess
import sys

import pytest
import torch

from tests.mpirun import ROOT, mpi_env
from tests.parallel.train_cases import pool, pooled_results

# gpt with 32 blocks of d_model 512: 101M parameters, 385 MB in fp32. Under zero3 at 4
# ranks with SGD a rank peaks near 270 MB (its shards of parameters and gradients, units
# gathered one or two at a time, reductions in flight); building the whole model first
# needs 400 MB. A 330 MB cap sits between.
MODEL = ["train.model_options.d_model=512", "train.model_options.heads=8",
         "train.model_options.layers=32", "train.model_options.seq_len=8",
         "train.model_options.n_samples=64", "train.model_options.vocab=128",
         'train.optimizer="sgd"', "train.steps=3", "train.global_batch_size=4",
         'train.progress="off"', 'train.out_dir=""']
FULL_MB = 385
CAP_MB = 330


def _run(tmp_path, name, ranks, cap_mb, *settings):
    out = tmp_path / f"{name}.json"
    # a fixed mmap threshold: freed multi-MB tensors go back at once (runtime/malloc.py)
    env = mpi_env({"HPCTRAIN_MMAP_THRESHOLD_KB": "256"})
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none",
           "-x", "HPCTRAIN_MMAP_THRESHOLD_KB", sys.executable,
           "tests/parallel/capped_train_worker.py", str(cap_mb), str(out), *MODEL, *settings]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    losses = json.loads(out.read_text())["losses"] if out.exists() else None
    return proc, losses


@pytest.mark.mpi
def test_a_model_above_the_cap_trains_under_zero3_with_deferred_init(tmp_path, stacked):
    from hpctrain.models import gpt

    with torch.device("meta"):
        model = gpt.factory(0, d_model=512, heads=8, layers=32, seq_len=8, n_samples=64,
                            vocab=128)[0]
    full_mb = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    assert full_mb > CAP_MB and round(full_mb) == FULL_MB

    single = stacked["capped-ref"]  # one process, uncapped, in the session's launches
    assert single["rc"] == 0, single["stdout"][-2000:] + single["stderr"][-3000:]
    want = single["summary"]["losses"]
    capped, got = _run(tmp_path, "zero3", 4, CAP_MB, 'train.strategy="zero3"')
    assert capped.returncode == 0, capped.stderr[-3000:]
    assert "deferred init" in capped.stdout
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    # control: the whole model built on every rank first does not fit under the cap
    whole, none = _run(tmp_path, "zero3-whole", 4, CAP_MB, 'train.strategy="zero3"',
                       "train.deferred_init=false")
    assert whole.returncode != 0 and none is None, whole.stdout[-2000:]
    assert "can't allocate memory" in whole.stderr, whole.stderr[-3000:]


STACKED = ["--model", "tests.fixtures.stacked:factory", "--steps", "20", "--global-batch-size",
           "8", "--progress", "off", "--out-dir", ""]
STACKED_RUNS = {"single": (None, []), "zero3": (2, ["--strategy", "zero3"]),
                "fsdp": (3, ["--strategy", "fsdp"]), "pipeline": (2, ["--strategy", "pipeline"])}

# the CLI runs of the LayerStack and the capped model's one-process reference share the
# session's launches (tests/parallel/train_cases.py)
pool(__name__, lambda tmp: [{"id": name, "world": ranks, "argv": STACKED + flags}
                            for name, (ranks, flags) in STACKED_RUNS.items()]
     + [{"id": "capped-ref", "world": None,
         "argv": [a for m in MODEL + ['train.strategy="single"'] for a in ("--set", m)]}],
     "stacked")


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


def _stacked_run(stacked, name):
    r = stacked[name]
    assert r["rc"] == 0, r["stdout"][-2000:] + r["stderr"][-3000:]
    return r["stdout"], r["summary"]["losses"]


@pytest.mark.mpi
def test_a_user_layerstack_trains_deferred_under_zero3_fsdp_and_the_pipeline(stacked):
    """A factory returning a LayerStack (tied embedding/head, a buffer, a frozen weight,
    uneven sizes): zero3 and fsdp build it with deferred init, the pipeline splits it at its
    layers, and all follow one process."""
    _, want = _stacked_run(stacked, "single")
    for name in ("zero3", "fsdp", "pipeline"):
        out, got = _stacked_run(stacked, name)
        assert ("deferred init" in out) == (name != "pipeline"), (name, out)
        assert stacked[name]["summary"]["world_size"] == STACKED_RUNS[name][0], name
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0,
                                   msg=name)


# ---- no MPI ---------------------------------------------------------------------------


def test_placeholders_hold_one_process_values_layer_by_layer():
    """Every tensor of the deferred gpt (tied head included) equals the real build; a
    placeholder costs one element; a tensor-parallel box of it is the box of the values."""
    from hpctrain.models.registry import build, build_deferred
    from hpctrain.parallel.deferred import (is_placeholder, materialize, sliced_placeholder,
                                            values)
    from hpctrain.parallel.orchestrator import defer_init, has_deferred
    from hpctrain.parallel.placement import Placement

    opts = dict(d_model=24, heads=4, layers=3, vocab=29, seq_len=8, n_samples=16)
    real = build("gpt", 5, **opts).model
    built, stack = build_deferred("gpt", 5, **opts)
    whole, none = build_deferred("tests.fixtures.awkward:factory", 0)  # a factory's module
    assert none is None and not any(p.is_meta for p in whole.model.parameters())
    n = defer_init(built.model, stack)
    model = built.model
    assert has_deferred(model) and n == len(dict(model.named_parameters()))
    assert model.head.weight is model.tok_emb.weight  # still tied, one placeholder
    for name, p in model.named_parameters():
        assert is_placeholder(p) and p.untyped_storage().nbytes() == 4, name
        assert torch.isnan(p.detach().as_strided((), ())), name  # poisons if used by mistake
    # the slice tensor parallel keeps of a fused qkv at tp rank 1 of 3: whole heads
    qkv = model.blocks[1].attn.qkv.weight
    part = sliced_placeholder(qkv, (24, 24), Placement(tuple(qkv.shape), (0, 8, 0),
                                                       view=((3, 24, 24), (3, 8, 24))))
    box = values(part).reshape(3, 8, 24)
    torch.testing.assert_close(box, real.blocks[1].attn.qkv.weight.detach()
                               .reshape(3, 24, 24)[:, 8:16], rtol=0, atol=0)
    assert materialize(model) == n and not has_deferred(model)
    for (name, p), (rname, r) in zip(model.state_dict().items(), real.state_dict().items()):
        assert name == rname
        torch.testing.assert_close(p, r, rtol=0, atol=0, msg=name)
