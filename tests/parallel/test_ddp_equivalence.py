"""Horovod DDP at 1, 2 and 4 ranks reproduces single-process training (fp32, rtol 1e-5).

The command lines run in one process per world size (tests/parallel/train_worker.py runs
each through hpctrain's CLI code in-process): the references in one plain process, then one
mpirun at 2 ranks and one at 4. The one-rank case is a real ``python -m hpctrain train``."""

import json

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.parallel.equivalence import Case, assert_case, assert_matches, summary, train_steps
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

# A global batch of 14 splits unevenly over 4 ranks (4,4,3,3) and, with grad_accum=2,
# into micro-batches of 7 that split 2,2,2,1; with grad_accum=3 into micro-batches of 5, 5
# and 4 (each weighted by its samples; the log says so).
COMMON = ["--steps", "20", "--global-batch-size", "14", "--weight-decay", "0.01",
          "--progress", "off", "--out-dir", ""]

# (model, optimizer, grad_accum, lr)
CASES = [
    ("mlp", "sgd", 1, "0.1"), ("mlp", "adamw", 1, "0.003"),
    ("mlp", "sgd", 3, "0.1"), ("mlp", "adamw", 2, "0.003"),
    ("gpt", "sgd", 1, "0.3"), ("gpt", "adamw", 1, "0.003"),
    ("gpt", "sgd", 2, "0.3"), ("gpt", "adamw", 2, "0.003"),
    # uneven sizes, tied weight, buffer, frozen and never-used parameters
    ("tests.fixtures.awkward:factory", "adamw", 1, "0.003"),
    ("tests.fixtures.awkward:factory", "sgd", 2, "0.3"),
    # BatchNorm running statistics: synchronized over ranks
    ("tests.fixtures.awkward:factory_batchnorm", "adamw", 2, "0.003"),
]

WORLDS = (2, 4)


def _args(model, opt, accum, lr):
    return ["--model", model, "--optimizer", opt, "--grad-accum", str(accum), "--lr", lr
            ] + COMMON


def _ident(c):
    return f"{c[0].split(':')[-1]}-{c[1]}-accum{c[2]}"


# The equivalence table: the one-process references, then each case at each world size.
TABLE = ([Case(f"single-{_ident(c)}", None, _args(*c)) for c in CASES]
         + [Case(f"ddp{n}-{_ident(c)}", n, _args(*c) + ["--strategy", "ddp"],
                 ref=f"single-{_ident(c)}", strategy="ddp") for n in WORLDS for c in CASES])
ROWS = {r.id: r for r in TABLE}

pool(__name__, lambda tmp: train_steps(TABLE))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return pooled_results(__name__, tmp_path_factory)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES, ids=_ident)
def test_ddp_matches_single(results, case, world):
    got, ref = assert_case(results, ROWS[f"ddp{world}-{_ident(case)}"])
    if case[2] == 3:
        assert ("train.global_batch_size = 14 is not a multiple of train.grad_accum = 3: each "
                "step runs micro-batches of 5, 5 and 4 samples") in results[
                    f"ddp{world}-{_ident(case)}"]["stdout"]
    if case[1] == "adamw":  # it learned something (sgd over 20 noisy steps need not)
        assert np.mean(ref["losses"][-5:]) < np.mean(ref["losses"][:5])


def test_ddp_one_rank_matches_single(results, tmp_path):
    # A real `python -m hpctrain train` under mpirun (the worker stands for it elsewhere).
    case = CASES[1]
    ref = summary(results, f"single-{_ident(case)}")
    path = tmp_path / "ddp1.json"
    run_mpi(1, ["-m", "hpctrain", "train", *_args(*case), "--strategy", "ddp", "--summary",
                str(path)], timeout=240)
    assert_matches(json.loads(path.read_text()), ref, keys=("losses",), name="ddp1")
