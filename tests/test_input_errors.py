"""Malformed input is one line, ``hpctrain: error: ...`` naming the key and what it takes, with
exit code 2: flags, TOML values, model options, config files and hpctrain's environment
variables (before MPI), and a model the plan cannot run (found building the plan, after MPI
started, on every rank: still one line and exit 2, no traceback, no MPI_Abort).

The table runs ``hpctrain.cli.main`` in this process (the CLI's own parsing, config,
preflight and model checks) with MPI's start replaced by a failure: a case that would reach
MPI fails the test. One subprocess checks the real exit code and stderr, one mpirun the
after-MPI path."""

import pytest

from hpctrain import cli
from hpctrain.errors import EnvError, SetupError, SetupTypeError, UsageError, as_setup_error
from tests.mpirun import run_mpi, run_single

BASE = ["train", "--model", "mlp", "--steps", "2", "--out-dir", "", "--progress", "off"]

CASES = [  # (flags, environment, words the one line holds)
    (["--set", "train.model_options.layers=-1"], {},
     "train.model_options.layers = -1: expected an integer >= 1"),
    (["--set", "train.model_options.layers=-2"], {}, "train.model_options.layers = -2"),
    (["--set", "train.model_options.hidden=0"], {}, "train.model_options.hidden = 0: expected an "
                                                     "integer >= 1"),
    (["--set", 'train.model_options.layers="2"'], {},
     "train.model_options.layers = '2': expected an integer for model 'mlp' (default 3)"),
    (["--set", "train.model_options.layers=2.5"], {}, "expected an integer"),
    (["--set", "train.model_options.bogus=1"], {}, "has no option(s) ['bogus']; accepted"),
    (["--model", "gpt", "--set", "train.model_options.dropout=1.5"], {},
     "train.model_options.dropout = 1.5: expected a probability in [0, 1)"),
    (["--model", "unet", "--set", "train.model_options.periodic=1"], {},
     "train.model_options.periodic = 1: expected true or false"),
    (["--set", "train.seed=99999999999999999999999"], {}, "train.seed = 99999999999999999999999: "
                                                          "must be <= 9223372036854775807"),
    (["--set", "train.lr_schedule_options.step_size=2"], {},
     "train.lr_schedule = 'constant' takes no options"),
    (["--ranks-per-node", "0"], {}, "argument --ranks-per-node: '0': expected a positive "
                                    "integer"),
    (["--lr", "abc"], {}, "argument --lr: invalid float value: 'abc'"),
    (["--mesh", "tp=2"], {}, "mesh tp=2 for world size 1: the degrees given multiply to 2, "
                             "which does not divide 1 ranks, the number launched"),
    (["--config", "{dir}"], {}, "is a directory; pass a TOML file"),
    (["--config", "{garbage}"], {}, "is not UTF-8 text"),
    (["--run-name", "x"], {}, "train.run_name = 'x' names a directory under train.out_dir, "
                              "which is empty"),
    (["--trace", "{file}/sub"], {}, "train.trace_dir (--trace) = "),
    ([], {"HPCTRAIN_MMAP_THRESHOLD_KB": "-5"},
     "HPCTRAIN_MMAP_THRESHOLD_KB='-5': expected an integer number of KB >= 0"),
    ([], {"HPCTRAIN_CKPT_FORCE_SERIAL": "2"}, "HPCTRAIN_CKPT_FORCE_SERIAL='2'"),
    ([], {"HPCTRAIN_COMM": "gloo"}, "HPCTRAIN_COMM='gloo' is not one of auto, nccl, mpi"),
    ([], {"HPCTRAIN_RANKS_PER_NODE": "0"}, "HPCTRAIN_RANKS_PER_NODE='0' is not a positive"),
    (["--steps", "0"], {}, "train.steps = 0: must be >= 1"),
    (["--optimizer", "lamb"], {}, "train.optimizer = 'lamb'"),
    (["--model", "no.such.module:factory"], {}, "no.such.module"),
    (["--model", "resnet"], {}, "resnet"),
    (["--mesh", "dp=3"], {}, "multiply to 3, not 1"),
    (["--strategy", "zero2", "--reduce-bucket-size", "0"], {},
     "zero.reduce_bucket_size = 0: must be >= 1"),
    (["--strategy", "fsdp", "--allgather-bucket-size", "1.5"], {},
     "fsdp.allgather_bucket_size = 1.5: expected an integer"),
    (["--strategy", "ddp", "--reduce-bucket-size", "4096"], {}, "--reduce-bucket-size 4096 sizes"),
]


def _paths(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "garbage.toml").write_bytes(b"\x00\xff\xfe\x89PNG garbage")
    (tmp_path / "file").write_text("")
    return {"dir": str(tmp_path / "dir.toml"), "garbage": str(tmp_path / "garbage.toml"),
            "file": str(tmp_path / "file")}


def test_malformed_input_is_one_line_before_mpi(tmp_path, monkeypatch, capsys):
    import hpctrain.runtime.world as world

    def no_mpi(*_args, **_kwargs):
        raise AssertionError("reached MPI")

    monkeypatch.setattr(world, "init_world", no_mpi)
    paths = _paths(tmp_path)
    for flags, env, words in CASES:
        flags = [f.format(**paths) for f in flags]
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            try:
                rc = cli.main(BASE + flags)
            except SystemExit as exc:  # argparse
                rc = exc.code
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1, (flags, env, rc, lines)
        assert lines[0].startswith("hpctrain: error: ") and words in lines[0], (flags, lines)
        assert "dp=-1" not in lines[0], lines  # the mesh's inferred degree is internal


def test_a_bad_environment_variable_is_one_line_from_the_command():
    # the real process: exit code 2, stderr one line, no traceback
    proc = run_single(["-m", "hpctrain", "train", "--model", "mlp", "--out-dir", ""],
                      env={"HPCTRAIN_CKPT_FORCE_SERIAL": "maybe"}, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "hpctrain: error: HPCTRAIN_CKPT_FORCE_SERIAL='maybe' is not a clear boolean; set it to "
        "one of 1, true, yes, on (on) or 0, false, no, off (off), or unset it"]


def test_strategy_checks_become_setup_errors_of_the_same_kind():
    err = as_setup_error(ValueError("layer 'head' (Linear) is not supported"), "plan 'domain'")
    assert type(err) is SetupError and isinstance(err, UsageError)
    assert str(err) == "plan 'domain': layer 'head' (Linear) is not supported"
    err = as_setup_error(TypeError("not a chain\n  of layers"))
    assert isinstance(err, SetupTypeError) and isinstance(err, TypeError)
    assert str(err) == "not a chain of layers"
    for kept in (EnvError("x"), RuntimeError("a bug"), KeyError("a bug")):
        assert as_setup_error(kept) is kept


def test_an_uncaught_user_error_in_a_script_is_one_line(monkeypatch, capsys):
    import sys

    from hpctrain.config import ConfigError
    from hpctrain.runtime import abort

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    abort.install_excepthook()
    try:
        raise ConfigError("train.warmup_steps = 10 is more than train.steps = 4")
    except ConfigError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)  # returns: no abort
    assert capsys.readouterr().err == ("hpctrain: error: train.warmup_steps = 10 is more than "
                                       "train.steps = 4\n")


@pytest.mark.mpi
def test_a_layer_the_domain_split_cannot_run_is_one_line_and_exit_2():
    proc = run_mpi(2, ["-m", "hpctrain", "train", "--model", "tests.fixtures.conv_head:factory",
                       "--strategy", "domain", "--steps", "2", "--out-dir", "",
                       "--progress", "off"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    ours = [ln for ln in proc.stderr.splitlines() if "hpctrain" in ln]
    # the domain check traces the forward: the op and the model's line that calls the layer
    assert len(ours) == 1 and ours[0].startswith(
        "hpctrain: error: domain parallel cannot split torch.nn.functional.linear at "
        "tests/fixtures/conv_head.py:22 (return self.head(self.body(x)))"), proc.stderr
    assert "Traceback" not in proc.stderr and "MPI_ABORT" not in proc.stderr
