"""Optimizers by name or factory, lr schedules, their checkpointed state, and step logging."""

import csv
import json
import math

import pytest
import torch

from hpctrain.cli import main
from hpctrain.config import ConfigError, TrainSection
from hpctrain.train.schedule import check_schedule, make_schedule, warmup_cosine_lr
from hpctrain.train.optimizers import check_optimizer, make_optimizer_factory
from tests.mpirun import run_single
from tests.parallel.train_cases import pool, pooled_results


def sgd_factory(params, lr, **options):
    """A user factory (train.optimizer = 'tests.train.test_optim:sgd_factory')."""
    return torch.optim.SGD(params, lr=lr, momentum=0.5, **options)


def _trajectory(make_optimizer, steps=5):
    """Parameters of a small model after each of `steps` optimizer steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = make_optimizer(model.parameters())
    out = []
    for i in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(i))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


BY_NAME = [  # (config fields, the optimizer built by hand)
    (dict(optimizer="Adam", lr=1e-2, weight_decay=0.01,
          optimizer_options={"betas": [0.8, 0.95], "eps": 1e-6}),
     lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01, betas=(0.8, 0.95), eps=1e-6)),
    (dict(optimizer="adagrad", lr=0.1, optimizer_options={"lr_decay": 0.01}),
     lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, weight_decay=0.0)),
    (dict(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-3),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (dict(optimizer="adamw", lr=3e-3),  # weight_decay 0 as always, not AdamW's own 0.01
     lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.0)),
    (dict(optimizer="tests.train.test_optim:sgd_factory", lr=0.05,
          optimizer_options={"nesterov": True}),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, nesterov=True)),
]


@pytest.mark.parametrize("fields, by_hand", BY_NAME)
def test_optimizer_by_name_follows_the_hand_built_trajectory(fields, by_hand):
    t = TrainSection(**fields)
    check_optimizer(t, "zero3")
    got, want = _trajectory(make_optimizer_factory(t)), _trajectory(by_hand)
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))


BAD_OPTIMIZERS = [
    (dict(optimizer="Nope"), "not a torch.optim optimizer"),
    (dict(optimizer="sgd", optimizer_options={"bogus": 1}), "unexpected keyword argument 'bogus'"),
    (dict(optimizer="adam", optimizer_options={"betas": [2.0, 0.9]}), "beta parameter"),
    (dict(optimizer="adamw", optimizer_options={"lr": 1.0}), r"train.lr \(--lr\)"),
    (dict(optimizer="LBFGS"), "closure"),
    (dict(optimizer="no.such.module:f"), "cannot import it"),
]


@pytest.mark.parametrize("fields, message", BAD_OPTIMIZERS)
def test_bad_optimizers_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_optimizer(TrainSection(**fields))


def test_factored_optimizers_are_refused_only_on_flat_shards():
    t = TrainSection(optimizer="Adafactor")
    check_optimizer(t, "ddp")
    with pytest.raises(ConfigError, match="flat shards of zero3"):
        check_optimizer(t, "zero3")


def _lrs(t, steps):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=t.lr)
    schedule, out = make_schedule(optimizer, t), []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step(1.0)
    return out, optimizer, schedule


def test_warmup_cosine_is_the_closed_form():
    t = TrainSection(lr=0.1, steps=20, lr_schedule="warmup_cosine", warmup_steps=5,
                     warmup_start_factor=0.2, min_lr=0.01)
    lrs, _, _ = _lrs(t, 20)
    for s, lr in enumerate(lrs):
        if s < 5:
            want = 0.1 * (0.2 + 0.8 * s / 5)
        else:
            want = 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi * (s - 5) / 15))
        assert lr == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert lrs[5] == pytest.approx(0.1) and warmup_cosine_lr(20, 0.1, 5, 20, 0.01) == 0.01


def test_constant_schedule_keeps_the_lr():
    lrs, _, _ = _lrs(TrainSection(lr=0.25), 4)
    assert lrs == [0.25] * 4


def test_a_torch_schedule_resumes_from_its_json_state():
    """StepLR computes from the group's lr (chainable): the checkpoint's param-group lr and
    the schedule state together continue the same lrs."""
    t = TrainSection(lr=1.0, lr_schedule="StepLR", lr_schedule_options={"step_size": 3,
                                                                        "gamma": 0.5})
    whole, _, _ = _lrs(t, 12)
    _, first_optimizer, first = _lrs(t, 7)
    saved = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=t.lr)
    schedule = make_schedule(optimizer, t)
    optimizer.param_groups[0].update(lr=first_optimizer.param_groups[0]["lr"])
    schedule.load_state_dict(saved)
    rest = []
    for _ in range(5):
        rest.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step(1.0)
    assert rest == whole[7:]
    with pytest.raises(ValueError, match="train.lr_schedule=StepLR"):
        make_schedule(optimizer, TrainSection()).load_state_dict(saved)


def test_one_cycle_and_cosine_default_to_the_run_steps_and_lr():
    t = TrainSection(lr=0.2, steps=10, optimizer="sgd", lr_schedule="OneCycleLR")
    check_schedule(t)
    lrs, _, schedule = _lrs(t, 10)
    assert schedule.scheduler.total_steps == 10 and max(lrs) == pytest.approx(0.2)
    t = TrainSection(lr=0.2, steps=10, lr_schedule="cosineannealinglr")
    assert _lrs(t, 10)[2].scheduler.T_max == 10


@pytest.mark.parametrize("fields, message", [
    (dict(lr_schedule="Nope"), "expected constant, warmup_cosine"),
    (dict(optimizer="Adagrad", lr_schedule="OneCycleLR"), "momentum"),
    (dict(lr_schedule="StepLR"), "step_size"),
    (dict(lr_schedule="LambdaLR"), "takes functions"),
    (dict(lr_schedule="StepLR", lr_schedule_options={"step_size": 2, "bogus": 1}), "bogus"),
])
def test_bad_schedules_are_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_schedule(TrainSection(**fields))


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "Nope"], "train.optimizer = 'Nope'"),
    (["--optimizer", "adam", "--set", "train.optimizer_options.bogus=1"], "bogus"),
    (["--lr-schedule", "Nope"], "train.lr_schedule = 'Nope'"),
    (["--lr-schedule", "warmup_cosine", "--set", "train.warmup_steps=9"], "warmup_steps = 9"),
])
def test_bad_input_lines_exit_2_with_one_line(flags, message, capsys, tmp_path):
    code = main(["train", "--model", "mlp", "--steps", "4", "--out-dir", str(tmp_path)] + flags)
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err


# ---- real runs: Adagrad + warmup_cosine, 20 steps; checkpoints at 10 and 20 ----------------

TRAIN = ["-m", "hpctrain", "train", "--model", "mlp", "--steps", "20", "--progress", "off",
         "--optimizer", "Adagrad", "--lr", "0.05", "--set", "train.optimizer_options.eps=1e-8",
         "--lr-schedule", "warmup_cosine", "--set", "train.warmup_steps=4",
         "--set", "train.min_lr=0.005", "--set", "train.report=false",
         "--set", "train.model_options.hidden=24", "--global-batch-size", "16",
         "--checkpoint-every", "10"]


# (name, ranks, strategy, resumed from): saved at 2 ranks under zero3, resumed at 1 under single
RUNS = [("single", None, "single", None), ("zero3", 2, "zero3", None),
        ("single-resumed", None, "single", "single"), ("zero3-resumed", 2, "zero3", "zero3"),
        ("zero3-to-single", None, "single", "zero3")]
CK = "ckpt-000010.h5"


def _steps(tmp):
    """The runs share the session's launches (tests/parallel/train_cases.py)."""
    return [{"id": name, "world": ranks, "after": [src] if src else [],
             "argv": TRAIN + ["--strategy", strategy, "--out-dir", str(tmp / name),
                              "--checkpoint-dir", str(tmp / f"{name}-ck")]
             + (["--resume", str(tmp / f"{src}-ck" / CK)] if src else [])}
            for name, ranks, strategy, src in RUNS]


pool(__name__, _steps, "adagrad")


@pytest.fixture(scope="module")
def adagrad(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


def _run(results, name):
    r = results[name]
    assert r["rc"] == 0, r["stdout"][-2000:] + r["stderr"][-3000:]
    with open(results["_tmp"] / name / "metrics.csv", newline="") as fh:
        rows = {int(row["step"]): row for row in csv.DictReader(fh)}
    return r["summary"]["losses"], rows


def _same_steps(a, b, rtol, steps=range(11, 21)):
    (losses_a, rows_a), (losses_b, rows_b) = a, b
    for s in steps:
        assert losses_b[s - 1] == pytest.approx(losses_a[s - 1], rel=rtol), s
        assert float(rows_b[s]["lr"]) == pytest.approx(float(rows_a[s]["lr"]), rel=1e-12), s


def test_adagrad_warmup_cosine_zero3_equals_single_and_resumes_anywhere(adagrad):
    single, zero3 = _run(adagrad, "single"), _run(adagrad, "zero3")
    assert adagrad["zero3"]["summary"]["world_size"] == 2
    _same_steps(single, zero3, 1e-5, range(1, 21))                # zero3 at 2 ranks = single
    _same_steps(single, _run(adagrad, "single-resumed"), 1e-6)
    _same_steps(zero3, _run(adagrad, "zero3-resumed"), 1e-6)
    # saved at 2 ranks under zero3, resumed at 1 rank under single
    _same_steps(single, _run(adagrad, "zero3-to-single"), 1e-5)
    lrs = [float(single[1][s]["lr"]) for s in range(1, 21)]
    assert lrs == pytest.approx([warmup_cosine_lr(s, 0.05, 4, 20, 0.005) for s in range(20)],
                                rel=1e-12, abs=1e-15)


def _without_schedule_state(path):
    """Make path a checkpoint as written before schedules were saved (resealed)."""
    import h5py

    from hpctrain.checkpoint.meta import JSON_ATTRS, seal

    with h5py.File(path, "r+") as f:
        del f.attrs["lr_schedule"]
        names = [n for n in json.loads(f.attrs[JSON_ATTRS]) if n != "lr_schedule"]
        f.attrs[JSON_ATTRS] = json.dumps(names)
        seal(f)


def test_run_name_tensorboard_and_a_checkpoint_without_schedule_state(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    common = ["-m", "hpctrain", "train", "--model", "mlp", "--steps", "3", "--progress", "off",
              "--out-dir", str(tmp_path), "--max-grad-norm", "1.0", "--set", "train.report=false",
              "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    run_single(common + ["--run-name", "first"])
    _without_schedule_state(tmp_path / "ck" / "ckpt-000002.h5")
    run_single(common + ["--run-name", "old", "--resume", str(tmp_path / "ck" / "ckpt-000002.h5")])
    first, old = (json.loads((tmp_path / n / "summary.json").read_text())["losses"]
                  for n in ("first", "old"))
    assert old == first  # the old checkpoint resumes as one of the constant schedule
    run_dir = tmp_path / "first"
    with open(run_dir / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 and all(float(r["grad_norm"]) > 0 and float(r["peak_rss_mb"]) > 50
                                  for r in rows)
    events = accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "lr", "grad_norm", "peak_rss_mb", "throughput_samples_per_s"} <= set(tags)
    losses = [e.value for e in events.Scalars("loss")]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert losses == pytest.approx([float(r["loss"]) for r in rows], rel=1e-6)
    assert not (tmp_path / "metrics.csv").exists()
