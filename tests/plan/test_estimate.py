"""The planner's arithmetic without MPI: ZeRO and Megatron formulas, counts that agree with
the real models, the feasibility filter, the command it prints, bad input."""

import json
import shlex
import resource
import time

from dataclasses import replace

import pytest
import torch

from hpctrain.cli import _overrides, build_parser, main
from hpctrain.config import load_config
from hpctrain.models.gpt import GPT, GPTBlock
from hpctrain.plan.candidates import Candidate, Request, candidates
from hpctrain.plan.command import plan
from hpctrain.plan.estimate import estimate, gpt_layer_activation, state_bytes
from hpctrain.plan.model_shape import ShapeError, gpt_shape, shape_of
from hpctrain.plan.render import command, toml
from hpctrain.plan.saved import SavedTensorMeter
from tests.mpirun import run_single

TINY = dict(layers=2, hidden=48, heads=4, vocab=68, seq=32)


def _args(*flags):
    return build_parser().parse_args(["plan", *flags])


@pytest.mark.parametrize("precision, optimizer, momentum, expected", [
    ("fp32", "adamw", 0.0, (4, 4, 8)),     # 16 bytes/param
    ("bf16", "adamw", 0.0, (2, 2, 12)),    # ZeRO's K = 12
    ("fp16", "sgd", 0.9, (2, 2, 8)),       # fp32 master + momentum
    ("fp32", "sgd", 0.0, (4, 4, 0)),
    ("fp32", "Adagrad", 0.0, (4, 4, 4)),   # any torch.optim class: its state is measured
    ("bf16", "rmsprop", 0.9, (2, 2, 12)),  # square average + momentum buffer + master
    ("fp32", "adadelta", 0.0, (4, 4, 8)),
])
def test_state_bytes_per_parameter(precision, optimizer, momentum, expected):
    assert state_bytes(precision, optimizer, momentum) == expected


def test_an_optimizer_hpctrain_cannot_train_with_is_refused():
    with pytest.raises(ValueError, match="not a torch.optim optimizer"):
        state_bytes("fp32", "adamm")
    with pytest.raises(ValueError, match="closure"):
        state_bytes("fp32", "lbfgs")


def test_autocast_states_are_fp32_whatever_the_precision():
    assert state_bytes("bf16", "adamw", autocast=True) == (4, 4, 8)
    shape = gpt_shape(**TINY)
    paper, autocast = (estimate(shape, Candidate(1, 4, 1, "zero1"),
                                Request(4, 4, 1, "bf16", global_batch=16, autocast=a))
                       for a in (False, True))
    psi = shape.params()
    assert paper.params + paper.grads + paper.optimizer == pytest.approx(4 * psi + 3 * psi)
    assert autocast.params + autocast.grads + autocast.optimizer == pytest.approx(8 * psi
                                                                                + 2 * psi)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_paper_formulas_mixed_precision(n):
    shape = gpt_shape(**TINY)
    req = Request(ranks=n, ranks_per_node=n, memory_gb=1, precision="bf16",
                  global_batch=8 * n)
    psi = shape.params()
    unit = max(shape.units())

    def states(flavour, sharding=""):
        e = estimate(shape, Candidate(1, n, 1, flavour, sharding), req)
        return e.params + e.grads + e.optimizer + e.gathered

    assert states("ddp") == 16 * psi
    assert states("zero1") == pytest.approx(4 * psi + 12 * psi / n)
    assert states("zero2") == pytest.approx(2 * psi + 14 * psi / n)
    assert states("zero3") == pytest.approx(16 * psi / n + 2 * unit)
    # FULL_SHARD prefetches the next unit in backward (bench plan: the engine's peak)
    assert states("fsdp", "FULL_SHARD") == pytest.approx(states("zero3") + 2 * unit)
    # SHARD_GRAD_OP keeps every unit gathered between forward and backward
    assert states("fsdp", "SHARD_GRAD_OP") == pytest.approx(16 * psi / n + 2 * psi)


def test_buffers_are_priced_from_the_bucket_sizes():
    from hpctrain.parallel.sharding.reduction import reduction_buffer_bytes

    shape = gpt_shape(**TINY)
    psi, unit, n = shape.params(), max(shape.units()), 4
    req = Request(ranks=n, ranks_per_node=n, memory_gb=1, precision="fp32", global_batch=32)

    def est(flavour, sharding="", **kw):
        return estimate(shape, Candidate(1, n, 1, flavour, sharding),
                        replace(req, **kw) if kw else req)

    b = 1 << 24
    assert est("ddp").buffers == 0
    assert est("zero1").buffers == pytest.approx(3 * 4 * unit / n)  # the step's reduce-scatter
    for flavour, sharding in (("zero2", ""), ("zero3", ""), ("fsdp", "FULL_SHARD")):
        e = est(flavour, sharding)
        assert e.buffers == pytest.approx(b + b * (n - 1) // n + 4 * unit)  # + a unit's grads
        assert e.total == pytest.approx(e.params + e.grads + e.optimizer + e.gathered +
                                        e.buffers + e.activations)
        small = est(flavour, sharding, reduce_bucket_size=4096)
        assert small.buffers == pytest.approx(reduction_buffer_bytes(4096, n) + 4 * unit)
        # under grad accumulation the earlier micro-batches keep every full gradient
        accum = est(flavour, sharding, reduce_bucket_size=4096, grad_accum=2)
        assert accum.buffers == pytest.approx(reduction_buffer_bytes(4096, n) + 4 * psi)
    # a unit that does not fit allgather_bucket_size is not prefetched
    assert est("fsdp", "FULL_SHARD").gathered == 2 * 4 * unit
    assert est("fsdp", "FULL_SHARD", allgather_bucket_size=4 * unit - 1).gathered == 4 * unit


def test_hybrid_shards_inside_a_node_and_replicates_across():
    shape = gpt_shape(**TINY)
    req = Request(ranks=8, ranks_per_node=4, memory_gb=1, global_batch=32)
    labels = [c.label() for c in candidates(shape, req)[0]]
    assert "fsdp:HYBRID" in labels
    assert "fsdp:HYBRID" not in [c.label() for c in candidates(
        shape, Request(ranks=8, ranks_per_node=8, memory_gb=1, global_batch=32))[0]]
    hybrid = estimate(shape, Candidate(1, 8, 1, "fsdp", "HYBRID_SHARD"), req)
    full = estimate(shape, Candidate(1, 8, 1, "fsdp", "FULL_SHARD"), req)
    o = state_bytes(req.precision, req.optimizer)[2]
    assert hybrid.optimizer == pytest.approx(o * shape.params() / 4)  # N = 4 per node
    assert hybrid.optimizer == 2 * full.optimizer and hybrid.comm > full.comm


def test_counts_agree_with_the_real_gpt():
    shape = gpt_shape(**TINY)
    model = GPT(TINY["vocab"], TINY["hidden"], TINY["heads"], TINY["layers"], TINY["seq"])
    assert shape.params() == sum(p.numel() for p in model.parameters())  # tied head once
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    assert sorted(shape.units())[-len(blocks):] == sorted(blocks)
    # two pipeline stages each hold a copy of the tied embedding
    from hpctrain.models.gpt import gpt_layers
    stack = gpt_layers(TINY["vocab"], TINY["hidden"], TINY["heads"], TINY["layers"],
                       TINY["seq"])
    first, last = stack.build([0, 1]), stack.build([2, 3])
    assert shape.params([0, 1]) == sum(p.numel() for p in first.parameters())
    assert shape.params([2, 3]) == sum(p.numel() for p in last.parameters())


def test_tp_split_counts_each_rank_slice():
    shape = gpt_shape(**TINY)
    h, v, s = TINY["hidden"], TINY["vocab"], TINY["seq"]
    per_block_split = (3 * h * h + 3 * h) + h * h + (4 * h * h + 4 * h) + 4 * h * h
    per_block_whole = 4 * h + h + h  # LayerNorms, proj and mlp.2 biases
    expected = TINY["layers"] * (per_block_split // 2 + per_block_whole) + v * h // 2 \
        + s * h + 2 * h
    assert shape.params(None, shape.tp_splits(2), 2) == expected


def test_gpt_block_activation_formula_matches_what_autograd_saves():
    s, h, a, b = 64, 96, 6, 3
    torch.manual_seed(0)
    block = GPTBlock(h, a)
    meter = SavedTensorMeter(lambda: list(block.parameters()))
    x = torch.randn(b, s, h, requires_grad=True)
    with meter:
        block(x).sum().backward()
    assert meter.peak == pytest.approx(b * gpt_layer_activation(s, h, a, 4), rel=0.01)
    # Megatron's 34 (fp16) = hpctrain's 16 elements x 2 bytes + two dropout masks;
    # its 5·a·s/h is the unfused attention this block does not keep
    assert gpt_layer_activation(s, h, a, 2) == pytest.approx(s * h * 32, rel=0.1)


def test_tensor_and_sequence_parallel_divide_activations():
    s, h, a = 128, 256, 8
    whole = gpt_layer_activation(s, h, a, 2)
    tp4 = gpt_layer_activation(s, h, a, 2, t=4)
    sp4 = gpt_layer_activation(s, h, a, 2, t=4, sp=True)
    assert sp4 < tp4 < whole
    assert tp4 == pytest.approx(2 * s * (h * (4 + 3) + 4 + a / 4))


def test_meta_forward_prices_a_sequential_model():
    shape = shape_of("mlp")
    assert shape.params() == sum(p.numel() for p in
                                 __import__("hpctrain.models.mlp", fromlist=["MLP"]).MLP()
                                 .parameters())
    assert [layer.is_block for layer in shape.layers] == [False, True, True, True, False]
    assert all(layer.saved for layer in shape.layers)


@pytest.mark.parametrize("factory", ["gpt2_factory", "llama_factory"])
def test_hugging_face_models_are_priced_layer_by_layer(factory):
    # split as the pipeline splits them (models/chain.py), so pipeline plans are priced too;
    # their forwards (masks built with .item()) do not run whole on the meta device
    from tests.fixtures import hf_models

    shape = shape_of(f"tests.fixtures.hf_models:{factory}")
    model = getattr(hf_models, factory)()[0]
    assert shape.pipelinable and len(shape.layers) == hf_models.LAYERS + 3  # + emb, norm, head
    assert shape.params() == sum(p.numel() for p in model.parameters())  # tied: once
    assert sum(layer.is_block for layer in shape.layers) == hf_models.LAYERS
    assert all(layer.saved for layer in shape.layers if layer.is_block)
    labels = [c.label() for c in candidates(shape, Request(4, 4, 1, global_batch=16))[0]]
    assert "pp2:1f1b ddpx2" in labels and "pp4:1f1b" in labels
    # tensor parallel from the model's plan (Llama's own, GPT-2's from hpctrain), alone and
    # under the pipeline; the vocabulary (97) padded to a multiple of tp
    assert "tp2 ddpx2" in labels and "pp2:1f1b tp2" in labels
    assert ("tp4" in labels) == (factory == "gpt2_factory")  # Llama: 2 key/value heads
    # a tp rank's activations are priced by a meta forward of its split: less in each block
    saved = [[sum(info.saved.values()) for info in layers if info.is_block]
             for layers in (shape.layers, shape.layers_at(2))]
    assert all(split < whole for whole, split in zip(*saved))


def test_every_candidate_validates_and_impossible_ones_are_left_out():
    shape = gpt_shape(**TINY)
    req = Request(ranks=4, ranks_per_node=4, memory_gb=1, global_batch=16)
    ok, refused = candidates(shape, req)
    labels = [c.label() for c in ok]
    assert "zero3" in labels and "pp4:1f1b" in labels and "tp2+sp zero1x2" in labels
    assert all(c.pp <= len(shape.layers) for c in ok)
    # heads tp cannot split: no tensor-parallel plan, the tensor check's reason
    odd = gpt_shape(**{**TINY, "heads": 3})
    ok, refused = candidates(odd, req)
    assert not [c for c in ok if c.tp > 1]
    assert any("3 attention heads do not split" in why for c, why in refused if c.tp > 1)
    # a vocabulary no tp divides is padded to a multiple of tp: those plans run
    # (the sharded dp flavours refuse it: their flat shards must line up across tp)
    ok, refused = candidates(gpt_shape(**{**TINY, "vocab": 67}), req)
    assert {c.tp for c in ok} == {1, 2, 4}
    assert "tp2 ddpx2" in [c.label() for c in ok]
    assert {c.label() for c, why in refused if "flat shards" in why} == {
        f"tp2{sp} {f}x2" for sp in ("", "+sp")
        for f in ("zero1", "zero2", "zero3", "fsdp", "fsdp:SHARD_GRAD_OP")}


def test_pipeline_batch_must_divide_into_micro_batches():
    shape = gpt_shape(**TINY)
    req = Request(ranks=2, ranks_per_node=2, memory_gb=1, global_batch=6, microbatches=4)
    ok, refused = candidates(shape, req)
    assert not [c for c in ok if c.pp > 1]
    assert any("microbatches" in why for _, why in refused)


def test_feasibility_filter_and_the_recommendation():
    flags = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "32000",
             "--seq", "2048", "--ranks", "4", "--precision", "bf16", "--global-batch", "16"]
    estimates, req, shape, best = plan(_args(*flags, "--memory-gb", "40"))
    assert best.fits and best.candidate.label() == "ddp"  # fits: the simplest plan
    estimates, req, shape, best = plan(_args(*flags, "--memory-gb", "10"))
    assert not best.fits and best.fits_with_ac and best.total_ac <= 10e9
    assert all(not e.fits for e in estimates if e.total > 10e9)
    estimates, req, shape, best = plan(_args(*flags, "--memory-gb", "1"))
    assert best is None


def test_command_and_toml_run_the_same_validated_config(tmp_path):
    flags = ["--layers", "8", "--hidden", "256", "--heads", "8", "--vocab", "512",
             "--seq", "128", "--ranks", "8", "--precision", "bf16", "--global-batch",
             "64", "--memory-gb", "0.05"]
    estimates, req, shape, best = plan(_args(*flags))
    for e in [best] + [e for e in estimates if e.candidate.pp > 1 or e.candidate.tp > 1][:6]:
        line = command(e, req, shape)
        assert line.startswith("mpirun -n 8 python -m hpctrain train ")
        args = build_parser().parse_args(shlex.split(line)[6:])
        from_flags = load_config(args.config, _overrides(args)).validate(8)
        path = tmp_path / "plan.toml"
        path.write_text(toml(e, req, shape))
        from_toml = load_config(str(path)).validate(8)
        assert from_flags.to_dict() == from_toml.to_dict()
        plan_ = from_flags.plan(8)
        c = e.candidate
        assert (plan_.pp, plan_.dp, plan_.tp) == (c.pp, c.dp, c.tp)


def test_table_strikes_out_what_does_not_fit(capsys):
    code = main(["plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab",
                 "32000", "--seq", "2048", "--ranks", "4", "--precision", "bf16",
                 "--global-batch", "16", "--memory-gb", "10"])
    out = capsys.readouterr().out
    assert code == 0
    assert "~~ddp~~" in out and "DOES NOT FIT" in out and "fits with AC" in out
    assert "s·b·h·(34 + 5·a·s/h)" in out and "pΨ + gΨ + oΨ/N" in out
    assert "--activation-checkpointing" in out and "[train.model_options]" in out
    main(["plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "32000",
          "--seq", "2048", "--ranks", "4", "--precision", "bf16", "--global-batch", "16",
          "--memory-gb", "10", "--fitting"])
    out = capsys.readouterr().out
    assert "~~" not in out and "fits with AC" in out


def test_json_and_chart(tmp_path, capsys):
    chart = tmp_path / "plan.png"
    code = main(["plan", "--model", "mlp", "--ranks", "2", "--memory-gb", "1", "--json",
                 "--chart", str(chart)])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ranks"] == 2 and data["recommended"]["plan"] == "ddp"
    assert {p["plan"] for p in data["plans"]} >= {"ddp", "zero3", "pp2:1f1b"}
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, words", [
    (["--hidden", "50", "--heads", "4", "--ranks", "2"], "not divisible by --heads 4"),
    (["--model", "nosuch.module:factory", "--ranks", "2"], "cannot import module"),
    (["--ranks", "0"], "give the ranks"),
    (["--model", "mlp", "--layers", "4", "--ranks", "2"], "describe the built-in gpt"),
    (["--ranks", "64", "--global-batch", "8"], "no plan runs on 64 ranks"),
    (["--ranks", "2", "--reduce-bucket-size", "0"], "--reduce-bucket-size 0: expected a positive"),
])
def test_bad_input_is_one_line_and_exit_2(flags, words, capsys):
    assert main(["plan", "--memory-gb", "80", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hpctrain plan: error:") and words in err[0]


def test_too_little_memory_says_what_the_smallest_plan_needs(capsys):
    code = main(["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab",
                 "32000", "--seq", "4096", "--nodes", "2", "--ranks-per-node", "4",
                 "--precision", "bf16", "--memory-gb", "16"])
    err = capsys.readouterr().err
    assert code == 1
    assert "the smallest plan, " in err and "over 8 ranks" in err
    assert "GB per rank; you gave 16 GB" in err


def test_shape_error_for_a_bad_description():
    with pytest.raises(ShapeError, match="--layers 0"):
        gpt_shape(0, 64, 4, 100, 16)


def test_70b_description_costs_seconds_and_little_memory():
    flags = ["-m", "hpctrain", "plan", "--layers", "80", "--hidden", "8192", "--heads", "64",
             "--vocab", "32000", "--seq", "4096", "--nodes", "8", "--ranks-per-node", "8",
             "--memory-gb", "80", "--precision", "bf16", "--global-batch", "512", "--json"]
    t0 = time.perf_counter()
    proc = run_single(flags, timeout=120)
    elapsed = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    data = json.loads(proc.stdout)
    h, L = 8192, 80
    assert data["parameters"] == L * (12 * h * h + 13 * h) + 32000 * h + 4096 * h + 2 * h
    assert data["recommended"] is not None
    assert elapsed < 60, elapsed
    # the largest child so far (this one or smaller): the bf16 weights alone are 130 GB
    assert rss_mb < 2000, rss_mb


@pytest.mark.parametrize("spec, tolerance", [
    ("mlp", 0.01),
    ("tests.fixtures.resnetish:factory", 0.25),  # blocks nested in a user's model
    ("tests.fixtures.vitish:factory", 0.25),     # meta attention keeps scores: errs high
])
def test_meta_forward_activations_against_a_real_step(spec, tolerance):
    from hpctrain.models import registry
    from hpctrain.parallel.activation_checkpointing import checkpoint_blocks

    shape = shape_of(spec)
    e = estimate(shape, Candidate(1, 1, 1, "single"),
                 Request(1, 1, 1, "fp32", global_batch=8))
    measured = []
    for checkpointing in (False, True):
        built = registry.build(spec, 0)
        model = built.model
        if checkpointing:
            checkpoint_blocks(model, is_main=False)
        x = torch.stack([built.dataset[i][0] for i in range(8)])
        y = torch.stack([built.dataset[i][1] for i in range(8)])
        meter = SavedTensorMeter(lambda: list(model.parameters()))
        with meter:
            built.loss_fn(model(x), y).backward()
        measured.append(meter.peak)
    assert e.activations == pytest.approx(measured[0], rel=tolerance)
    assert e.activations_kept == pytest.approx(measured[1], rel=tolerance)
    assert e.activations_kept < e.activations
