"""Tensor parallel (and sequence parallel) reproduces single-process training: the built-in
gpt at tp=2 and tp=4 with sequence parallel on and off, dropout 0 and 0.1; tp=2 x dp=2 under
every data-parallel flavour; tp=2 x pp=2; dp=2 x pp=2 x tp=2 at 8 ranks; the awkward model
with a user TP plan from a TOML file. Hugging Face models (tiny, random init, vocabulary 97:
padded to a multiple of tp): GPT-2 (pad_token_id set) at tp=2 and tp=4 from the plan
hpctrain writes for it, Llama with a padding_idx embedding at pp=2 x tp=2 from its own plan;
their final parameters are one process's, checkpointed with the real vocabulary, and the
tp=4 checkpoint resumes on one process. fp32, 20 steps, sgd and adamw, losses and parameter
norm within rtol 1e-5 of one process (clipping cases: the global norm counts every element
once across tp, pp and dp).

A checkpoint written at tp=2 x pp=2 resumes under single, dp=4 zero3 and tp=4, one written
at tp=4 back at tp=2 x pp=2, one written at tp=2 x dp=2 under zero3 under single, on the
single-process trajectory; ``ckpt export`` of
the tp=2 x pp=2 checkpoint is the one-process model."""

from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.mpirun import run_mpi, run_single
from tests.parallel.equivalence import Case, assert_case, summary, train_steps
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

STEPS = 20
GPT = ["--model", "gpt", "--set", "train.model_options.vocab=68",
       "--set", "train.model_options.n_samples=256", "--global-batch-size", "8"]
AWKWARD = ["--model", "tests.fixtures.awkward:factory_tp", "--global-batch-size", "16",
           "--optimizer", "adamw", "--lr", "0.01"]
OPT = {"sgd": ["--optimizer", "sgd", "--lr", "0.3"],
       "adamw": ["--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"]}
COMMON = ["--progress", "off", "--out-dir", ""]


def _gpt(opt, dropout=0.0, clip=False):
    return (GPT + OPT[opt] + ["--set", f"train.model_options.dropout={dropout}"]
            + (["--max-grad-norm", "0.5"] if clip else []))


def _sp(on):
    return ["--set", f"tensor.sequence_parallel={'true' if on else 'false'}"]


# id: (ranks, reference key, plan flags); the reference key is (opt, dropout, clip)
GPT_CASES = {
    "tp2-sgd": (2, ("sgd", 0.0, False), ["--strategy", "tensor"] + _sp(False)),
    "tp2-sgd-sp": (2, ("sgd", 0.0, False), ["--strategy", "tensor"] + _sp(True)),
    "tp2-adamw-clip": (2, ("adamw", 0.0, True), ["--strategy", "tensor"] + _sp(False)),
    "tp2-adamw-sp-clip": (2, ("adamw", 0.0, True), ["--strategy", "tensor"] + _sp(True)),
    "tp2-dropout-sp": (2, ("adamw", 0.1, False), ["--strategy", "tensor"] + _sp(True)),
    "tp4-sgd-sp": (4, ("sgd", 0.0, False), ["--strategy", "tensor"] + _sp(True)),
    "tp4-adamw": (4, ("adamw", 0.0, True), ["--strategy", "tensor"] + _sp(False)),
    "tp4-dropout": (4, ("adamw", 0.1, False), ["--strategy", "tensor"] + _sp(False)),
    "tp4-dropout-sp": (4, ("adamw", 0.1, False), ["--strategy", "tensor"] + _sp(True)),
    "tp2dp2-ddp": (4, ("sgd", 0.0, False), ["--mesh", "tp=2,dp=2", "--dp-flavour", "ddp"]
                   + _sp(False)),
    "tp2dp2-zero1-sp": (4, ("adamw", 0.0, True), ["--mesh", "tp=2,dp=2", "--dp-flavour",
                                                   "zero1"] + _sp(True)),
    "tp2dp2-zero2-sp": (4, ("sgd", 0.0, False), ["--mesh", "tp=2,dp=2", "--dp-flavour",
                                                  "zero2"] + _sp(True)),
    "tp2dp2-zero3": (4, ("adamw", 0.0, True), ["--mesh", "tp=2,dp=2", "--dp-flavour",
                                               "zero3"] + _sp(False)),
    "tp2dp2-fsdp-sp": (4, ("adamw", 0.0, False), ["--mesh", "tp=2,dp=2", "--dp-flavour",
                                                  "fsdp"] + _sp(True)),
    "tp2pp2-sp": (4, ("adamw", 0.0, True), ["--strategy", "pipeline", "--mesh", "pp=2,tp=2"]
                  + _sp(True)),
    "tp2pp2-sgd": (4, ("sgd", 0.0, False), ["--strategy", "pipeline", "--mesh", "pp=2,tp=2",
                                            "--set", "pipeline.schedule=gpipe"] + _sp(False)),
    "3d-zero3-sp": (8, ("adamw", 0.0, True), ["--strategy", "pipeline", "--mesh",
                                              "dp=2,pp=2,tp=2", "--dp-flavour", "zero3"]
                    + _sp(True)),
    "3d-ddp-sgd": (8, ("sgd", 0.0, False), ["--strategy", "pipeline", "--mesh",
                                            "dp=2,pp=2,tp=2"] + _sp(False)),
}
AWKWARD_CASES = {"awkward-tp2": (2, ["--strategy", "tensor"]),
                 "awkward-tp2dp2-zero3": (4, ["--mesh", "tp=2,dp=2", "--dp-flavour", "zero3"])}
# checkpoint chain: (id, ranks, flags, steps, resume from, after)
CKPT = [("ck-pp2tp2", 4, ["--strategy", "pipeline", "--mesh", "pp=2,tp=2"] + _sp(True), 10,
         None, ()),
        ("ck-single", None, [], STEPS, "ck-pp2tp2", ("ck-pp2tp2",)),
        ("ck-zero3", 4, ["--strategy", "zero3"], STEPS, "ck-pp2tp2", ("ck-pp2tp2",)),
        ("ck-tp4", 4, ["--strategy", "tensor"], 15, "ck-pp2tp2", ("ck-pp2tp2",)),
        ("ck-back", 4, ["--strategy", "pipeline", "--mesh", "pp=2,tp=2"], STEPS, "ck-tp4",
         ("ck-tp4",)),
        # zero3's flat shards of tp slices (the qkv's whole-head boxes included)
        ("ck-tp2dp2-zero3", 4, ["--mesh", "tp=2,dp=2", "--dp-flavour", "zero3"] + _sp(True),
         10, None, ()),
        ("ck-zero3-single", None, [], STEPS, "ck-tp2dp2-zero3", ("ck-tp2dp2-zero3",))]
CK_KEY = ("adamw", 0.0, False)
# Hugging Face models: id -> (ranks, model, flags); every run checkpoints its final state
HF_MODELS = {"gpt2": "tests.fixtures.hf_models:gpt2_tp_factory",
             "llama": "tests.fixtures.hf_models:llama_pp_tp_factory"}
HF_CASES = {"gpt2-tp2": (2, "gpt2", ["--strategy", "tensor"]),
            "gpt2-tp4": (4, "gpt2", ["--strategy", "tensor"]),
            "llama-pp2tp2": (4, "llama", ["--strategy", "pipeline", "--mesh", "pp=2,tp=2",
                                          "--set", "pipeline.microbatches=2"])}
STATE_SCRIPT = str(Path(__file__).with_name("tensor_state_script.py"))


def _hf(model, ck_dir, every=STEPS):
    """A Hugging Face case's flags: its final state (and every ``every`` steps) saved."""
    return ["--model", HF_MODELS[model], "--global-batch-size", "8", "--optimizer", "adamw",
            "--lr", "0.003", "--checkpoint-dir", str(ck_dir), "--checkpoint-every", str(every),
            "--keep", "0", "--steps", str(STEPS)] + COMMON


def _ref_id(key):
    return "ref-" + "-".join(map(str, key))


def _row(cid, world, argv, ref=None, steps=STEPS, strategy=None, after=()):
    """A row checked as tensor runs are: its first ``steps`` losses (a resumed run's history
    included) and, when it ends at the reference's last step, its parameter norm."""
    return Case(cid, world, argv, ref=ref, strategy=strategy, steps=steps, prefix=True,
                keys=("losses", "param_norm") if steps == STEPS else ("losses",),
                after=tuple(after))


def _table(tmp):
    keys = {k for _, k, _ in GPT_CASES.values()} | {CK_KEY}
    rows = [_row(_ref_id(k), None,
                 _gpt(*k) + COMMON + ["--steps", str(STEPS)] +
                 (["--checkpoint-dir", str(tmp / "ref-ck"), "--checkpoint-every", "10",
                   "--keep", "0"] if k == CK_KEY else [])) for k in sorted(keys)]
    rows.append(_row("ref-awkward", None, AWKWARD + COMMON + ["--steps", str(STEPS)]))
    for cid, (ranks, key, flags) in GPT_CASES.items():
        rows.append(_row(cid, ranks, _gpt(*key) + COMMON + flags + ["--steps", str(STEPS)],
                         _ref_id(key), strategy="*tensor*"))
    # the user's plan, as TOML
    toml = tmp / "awkward_tp.toml"
    for cid, (ranks, flags) in AWKWARD_CASES.items():
        rows.append(_row(cid, ranks, AWKWARD + COMMON + flags + ["--config", str(toml),
                                                                 "--steps", str(STEPS)],
                         "ref-awkward"))
    saved_at = {cid: n for cid, _, _, n, _, _ in CKPT}
    for cid, ranks, flags, n, src, after in CKPT:
        ck = ["--checkpoint-dir", str(tmp / cid), "--checkpoint-every", str(n), "--keep", "0"]
        if src is not None:
            ck += ["--resume", str(tmp / src / f"ckpt-{saved_at[src]:06d}.h5")]
        rows.append(_row(cid, ranks, _gpt(*CK_KEY) + COMMON + flags + ck + ["--steps", str(n)],
                         None if src is None else _ref_id(CK_KEY), n, after=after))
    for model in HF_MODELS:
        rows.append(_row(f"ref-{model}", None, _hf(model, tmp / f"ref-{model}")))
    for cid, (ranks, model, flags) in HF_CASES.items():
        every = 10 if cid == "gpt2-tp4" else STEPS  # its step 10 resumes on one process
        rows.append(_row(cid, ranks, _hf(model, tmp / cid, every) + flags, f"ref-{model}",
                         strategy="*tensor*"))
    # the tp=4 run's step-10 checkpoint (vocabulary 97 over 4 ranks of 25 rows) on one process
    rows.append(_row("gpt2-tp4-single", None, _hf("gpt2", tmp / "gpt2-tp4-single") + [
        "--resume", str(tmp / "gpt2-tp4" / "ckpt-000010.h5")], "ref-gpt2", after=["gpt2-tp4"]))
    return rows


def _steps(tmp):
    (tmp / "awkward_tp.toml").write_text('[tensor.plan]\ninp = "colwise"\nmid = "rowwise"\n')
    return train_steps(_table(tmp)) + [
        {"id": f"state-{ranks}", "world": ranks, "script": STATE_SCRIPT} for ranks in (2, 4, 8)]


pool(__name__, _steps)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return {**res, "_rows": {r.id: r for r in _table(res["_tmp"])}}


def _same(results, cid):
    assert_case(results, results["_rows"][cid])


@pytest.mark.parametrize("cid", GPT_CASES)
def test_gpt_matches_single(results, cid):
    _same(results, cid)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_full_state_dict_and_memory_report(results, ranks):
    """tensor_state_script.py asserted on every rank (an assertion aborts the launch) that
    full_state_dict is the one-process model and memory_report the tp-local bytes."""
    assert results[f"state-{ranks}"]["rc"] == 0


def test_dropout_masks_matter(results):
    """The dropout cases are not trivially equal: dropout changes the trajectory."""
    a = summary(results, _ref_id(("adamw", 0.1, False)))["losses"]
    b = summary(results, _ref_id(("adamw", 0.0, False)))["losses"]
    assert max(abs(x - y) for x, y in zip(a, b)) > 1e-3


def _model_state(path) -> dict:
    with h5py.File(path, "r") as f:
        return {k: np.asarray(f["model"][k]) for k in f["model"]}


@pytest.mark.parametrize("cid", HF_CASES)
def test_hugging_face_models_match_single(results, cid):
    """Losses and every final parameter (the vocabulary's 97 rows whatever tp) are one
    process's; Llama's padding row stays zero (its owner keeps its gradient zero)."""
    model = HF_CASES[cid][1]
    _same(results, cid)
    tmp, final = results["_tmp"], f"ckpt-{STEPS:06d}.h5"
    mine, want = _model_state(tmp / cid / final), _model_state(tmp / f"ref-{model}" / final)
    assert sorted(mine) == sorted(want)
    for k, v in want.items():
        assert mine[k].shape == v.shape, k
        # atol: as in test_export_is_the_whole_model, AdamW's steps on elements whose
        # gradient is (near) rounding noise: GPT-2's attention key biases get exactly zero
        np.testing.assert_allclose(mine[k], v, rtol=1e-5, atol=2e-5, err_msg=f"{cid} {k}")
    emb = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}[model]
    assert mine[emb].shape[0] == 97
    if model == "llama":
        assert not mine[emb][1].any()  # pad_token_id = 1


def test_a_padded_vocabulary_checkpoint_resumes_on_one_process(results):
    _same(results, "gpt2-tp4-single")


@pytest.mark.parametrize("cid", AWKWARD_CASES)
def test_user_plan_matches_single(results, cid):
    _same(results, cid)


@pytest.mark.parametrize("cid", [c[0] for c in CKPT if c[4] is not None])
def test_checkpoint_reshards(results, cid):
    _same(results, cid)


def test_export_is_the_whole_model(results):
    summary(results, "ck-pp2tp2")
    tmp = results["_tmp"]
    out = {}
    for name, path in (("tp", tmp / "ck-pp2tp2" / "ckpt-000010.h5"),
                       ("single", tmp / "ref-ck" / "ckpt-000010.h5")):
        dest = tmp / f"export-{name}.h5"
        run_single(["-m", "hpctrain", "ckpt", "export", str(path), str(dest)])
        with h5py.File(dest, "r") as f:
            out[name] = {k: np.asarray(f[k]) for k in _datasets(f)}
    assert sorted(out["tp"]) == sorted(out["single"]) and out["tp"]
    for k, v in out["single"].items():
        # atol: the attention key bias gets an exactly-zero gradient (softmax ignores a
        # per-row shift), so under AdamW it is rounding noise of ~1e-6 in any two runs.
        np.testing.assert_allclose(out["tp"][k], v, rtol=1e-5, atol=2e-5, err_msg=k)


def _datasets(f) -> list:
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


def test_a_layernorm_left_out_of_sequence_parallel_is_caught(tmp_path):
    """A user plan that splits the sequence but leaves the LayerNorms out of the
    sequence_parallel style would train each tp rank's copy on its own chunk: the first
    step finds their gradients differ and stops the job, naming the parameter."""
    plan = ('{"tok_emb"="vocab_embedding","pos_emb"="sequence_parallel",'
            '"blocks.*.attn.qkv"={style="colwise",parts=3,heads=4},'
            '"blocks.*.attn.proj"="rowwise","blocks.*.mlp.0"="colwise",'
            '"blocks.*.mlp.2"="rowwise","head"="vocab_head"}')
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--strategy", "tensor", "--steps", "2"] + GPT
                   + COMMON + _sp(True) + ["--set", f"tensor.plan={plan}"], check=False,
                   timeout=120)
    assert proc.returncode != 0
    assert ("the gradient of 'blocks.0.ln1.weight' differs between the 2 ranks of group 'tp'"
            in proc.stdout + proc.stderr), proc.stderr[-3000:]
    assert "give its module the 'sequence_parallel' style" in proc.stdout + proc.stderr
