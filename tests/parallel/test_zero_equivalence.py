"""ZeRO stages 1-3 at 2 and 4 ranks reproduce single-process training (fp32, rtol 1e-5).

The command lines run in one process per world size (tests/parallel/train_worker.py runs
each through hpctrain's CLI code in-process): the references in one plain process, then one
mpirun at 2 ranks and one at 4. One case also runs as a real ``python -m hpctrain train``
under mpirun, which must give the worker's numbers."""

import json

import pytest

from tests.mpirun import run_mpi
from tests.parallel.equivalence import Case, assert_case, assert_matches, train_steps
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

# A global batch of 14 splits unevenly over 4 ranks (4,4,3,3) and, with grad_accum=2,
# into micro-batches of 7 that split 2,2,2,1.
COMMON = ["--steps", "20", "--global-batch-size", "14", "--weight-decay", "0.01",
          "--progress", "off", "--out-dir", ""]
LR = {("mlp", "sgd"): "0.1", ("gpt", "sgd"): "0.3", ("awkward", "sgd"): "0.3"}
SPEC = {"mlp": "mlp", "gpt": "gpt", "awkward": "tests.fixtures.awkward:factory",
        "awkward_bn": "tests.fixtures.awkward:factory_batchnorm"}

# (world, strategy, model, optimizer, grad_accum): every stage meets every model, both
# optimizers, both world sizes and both accumulation settings; not the full product.
CASES = [
    (2, "zero1", "mlp", "sgd", 1), (4, "zero1", "mlp", "adamw", 2),
    (2, "zero1", "gpt", "adamw", 1), (4, "zero1", "gpt", "sgd", 2),
    (2, "zero1", "awkward", "adamw", 2), (4, "zero1", "awkward", "sgd", 1),
    (4, "zero1", "awkward_bn", "adamw", 2),
    (2, "zero2", "mlp", "adamw", 1), (4, "zero2", "mlp", "sgd", 2),
    (2, "zero2", "gpt", "sgd", 2), (4, "zero2", "gpt", "adamw", 1),
    (4, "zero2", "awkward", "adamw", 2), (2, "zero2", "awkward", "sgd", 1),
    (2, "zero2", "awkward_bn", "adamw", 1), (4, "zero2", "awkward_bn", "sgd", 2),
    (2, "zero3", "mlp", "adamw", 2), (4, "zero3", "mlp", "sgd", 1),
    (2, "zero3", "gpt", "adamw", 2), (4, "zero3", "gpt", "adamw", 1),
    (4, "zero3", "gpt", "sgd", 2),
    (2, "zero3", "awkward", "adamw", 1), (4, "zero3", "awkward", "sgd", 2),
    (4, "zero3", "awkward_bn", "adamw", 2), (2, "zero3", "awkward_bn", "sgd", 1),
]


def _args(model, opt, accum):
    lr = LR.get((model.removesuffix("_bn"), opt), "0.003")
    return ["--model", SPEC[model], "--optimizer", opt, "--grad-accum", str(accum), "--lr", lr
            ] + COMMON


def _ident(case):
    return "-".join(map(str, case))


def _ref_id(model, opt, accum):
    return f"single-{model}-{opt}-{accum}"


# The equivalence table: one reference per (model, optimizer, grad_accum), then the cases.
TABLE = ([Case(_ref_id(*key), None, _args(*key)) for key in dict.fromkeys(c[2:] for c in CASES)]
         + [Case(_ident(c), c[0], _args(*c[2:]) + ["--strategy", c[1]], ref=_ref_id(*c[2:]),
                 strategy=c[1]) for c in CASES])
ROWS = {r.id: r for r in TABLE}

pool(__name__, lambda tmp: train_steps(TABLE))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.parametrize("case", CASES, ids=_ident)
def test_zero_matches_single(results, case):
    assert_case(results, ROWS[_ident(case)])


def test_real_cli_launch_matches_single_and_the_worker(results, tmp_path):
    # The in-process worker stands for `python -m hpctrain train` under mpirun: prove it once.
    case = (2, "zero3", "awkward_bn", "sgd", 1)
    path = tmp_path / "zero.json"
    run_mpi(2, ["-m", "hpctrain", "train", *_args(*case[2:]), "--strategy", case[1],
                "--summary", str(path)], timeout=240)
    got = json.loads(path.read_text())
    assert_matches(got, results[_ref_id(*case[2:])]["summary"], world=2, strategy="zero3")
    worker = results[_ident(case)]["summary"]
    assert got["losses"] == worker["losses"] and got["param_norm"] == worker["param_norm"]
