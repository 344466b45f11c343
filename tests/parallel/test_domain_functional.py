"""Functions a domain model's forward calls itself (tests/fixtures/domain_functional.py):
made exact on tiles (equal to one process, forward and backward, at dom=2, 3, 4 and 2x2;
the CLI trains one as one process does) or refused with the op and the model's line (in the
one-process check, on every rank's tiles, and by the CLI with exit 2 before MPI)."""

import inspect
import os

import pytest
import torch

from hpctrain.data.sampler import collate
from hpctrain.parallel.domain.functional import check
from tests.fixtures import domain_functional as D
from tests.mpirun import run_mpi
from tests.parallel.equivalence import assert_matches, summary
from tests.parallel.train_cases import pool, pooled_results

HERE = os.path.dirname(os.path.abspath(__file__))


def _refused_line(name) -> int:
    lines, start = inspect.getsourcelines(D.REFUSED[name][1])
    return start + next(i for i, ln in enumerate(lines) if "# refused" in ln)


def _sample(data):
    return collate(data, range(2))[0]


@pytest.mark.parametrize("name", list(D.SUPPORTED))
def test_check_passes_what_is_made_exact(name):
    model, data, _ = D.build(name)
    check(model, _sample(data))


@pytest.mark.parametrize("name", list(D.REFUSED))
def test_check_refuses_with_the_op_and_the_line(name):
    model, data, _ = D.build(name)
    with pytest.raises(ValueError) as info:
        check(model, _sample(data))
    msg = str(info.value)
    assert f"cannot split {D.REFUSED[name][0]}" in msg, msg
    assert f" at tests/fixtures/domain_functional.py:{_refused_line(name)} " in msg, msg
    assert "; fix: " in msg and "\n" not in msg


def test_check_refuses_a_layer_and_an_output_that_is_not_a_field():
    model, data, _ = D.build("gate")
    model.inp = torch.nn.Conv2d(1, D.CH, 3, padding=1, padding_mode="reflect")
    with pytest.raises(ValueError, match=r"cannot split Conv2d at .*padding_mode='reflect'"):
        check(model, _sample(data))
    head = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(2, 3))
    with pytest.raises(ValueError, match=r"output \(\(2, 3\)\) is not a field split"):
        check(head, _sample(data))


ARGS = ["-m", "hpctrain", "train", "--steps", "8", "--global-batch-size", "4", "--lr", "0.05",
        "--progress", "off", "--out-dir", ""]
BLOCKS = ARGS[3:] + ["--model", "tests.fixtures.domain_functional:blocks"]

# The CLI's two runs and the tiles worker at 2 and 4 ranks join the session's pool
# (tests/parallel/train_cases.py), in the launches the other pooled modules make anyway.
TILE_RANKS = (2, 4)
pool(__name__, lambda tmp: [
    {"id": "one", "world": None, "argv": BLOCKS},
    {"id": "dom", "world": 2, "argv": BLOCKS + ["--strategy", "domain", "--mesh", "dom=2",
                                                "--set", "train.activation_checkpointing=true"]}]
    + [{"id": f"tiles-{n}", "world": n,
        "script": os.path.join(HERE, "domain_functional_worker.py")} for n in TILE_RANKS],
     "trained")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.mpi
@pytest.mark.parametrize("n", TILE_RANKS)
def test_functions_on_tiles_match_one_process(trained, n):
    out = trained[f"tiles-{n}"]["stdout"]  # rank 0's; the worker's assertions abort its launch
    assert "domain functional ok:" in out and f"on {n} ranks" in out, out


@pytest.mark.mpi
def test_cli_trains_a_functional_model_as_one_process(trained):
    """max_pool2d(x, 3, 1, 1), avg_pool2d, nearest interpolate of an odd coarse grid and a
    global mean gate in each block, at dom=2, the blocks recomputed in backward."""
    assert_matches(summary(trained, "dom"), summary(trained, "one"), steps=8, world=2,
                   strategy="domain", keys=("losses", "param_norm"), name="dom=2")


@pytest.mark.mpi
def test_cli_refuses_before_mpi_with_one_line():
    proc = run_mpi(2, ARGS + ["--model", "tests.fixtures.domain_functional:flatten_linear",
                              "--strategy", "domain", "--mesh", "dom=2"], check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpctrain:")]
    assert lines == [lines[0]] and lines[0].startswith(
        "hpctrain: error: domain parallel cannot split Tensor.flatten at "
        f"tests/fixtures/domain_functional.py:{_refused_line('flatten_linear')} "), proc.stderr
    assert "launcher=" not in proc.stdout + proc.stderr  # MPI never started
