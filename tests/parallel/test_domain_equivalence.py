"""`train --strategy domain --model unet` at 1 rank, dom=2, dom=4 and dp=2,dom=2 reproduces single
(fp32, losses over 20 steps within rtol 1e-5); a domain checkpoint resumes at another
decomposition and in single on the same trajectory.

The command lines run many per process (tests/parallel/train_worker.py runs each through
hpctrain's CLI code in-process): one launch per world size, plus the HYBRID_SHARD case, whose
pretend ranks-per-node a process fixes once."""

import pytest

from tests.parallel.equivalence import Case, assert_case, train_steps
from tests.parallel.train_cases import pool, pooled_results

pytestmark = pytest.mark.mpi

# A 36x36 grid: its U-Net levels 36/18/9 split unevenly (dom=4: 9 | 5,5,4,4 | 3,2,2,2 rows;
# dom=2x2: 18 | 9 | 5,4 per side), and the periodic (circular) convs wrap across ranks.
BASE = ["--model", "unet", "--set", "train.model_options={size = 36}",
        "--optimizer", "adamw", "--lr", "0.003",
        "--global-batch-size", "4", "--progress", "off", "--out-dir", ""]

# Overlap (interior while halos fly) is off by default; dom=2x2 runs with it on.
MESHES = {"single": (None, "", False), "dom=2": (2, "dom=2", False),
          "dom=4": (4, "dom=4", False), "dom=2x2": (4, "dom=2x2", True),
          "dp=2,dom=2": (4, "dp=2,dom=2", False)}
# Composed plans: the dom=2 tiles of each of dp=2 replicas, the replicas kept in step by each
# data-parallel flavour (gradients summed over dp and over the tiles).
FLAVOURS = {"zero1": ("zero1", []), "zero2": ("zero2", []), "zero3": ("zero3", []),
            "fsdp": ("fsdp", []),
            "fsdp-SHARD_GRAD_OP": ("fsdp", ["--sharding-strategy", "SHARD_GRAD_OP"])}
HYBRID = ("fsdp", ["--sharding-strategy", "HYBRID_SHARD", "--ranks-per-node", "2"])
KEYS = ("losses", "param_norm")  # compared with the reference (the U-Net has no buffers)


def _step(tmp, cid, world, extra, steps=20, after=(), strategy=None, **kw):
    """A row (``ref`` "ref" unless it writes the checkpoint others resume)."""
    return Case(cid, world, BASE + ["--steps", str(steps), *extra],
                ref=None if cid in ("ref", "save", "save-composed") else "ref",
                strategy=strategy, keys=KEYS, after=tuple(after),
                env={"HPCTRAIN_DATA_DIR": str(tmp / "data")}, **kw)


def _composed(flavour, extra):
    return ["--mesh", "dom=2,dp=2", "--dp-flavour", flavour, *extra]


def _table(tmp):
    steps = [_step(tmp, "ref", None, [])]
    for name, (world, mesh, overlap) in MESHES.items():
        if world is not None:
            steps.append(_step(tmp, name, world, ["--strategy", "domain", "--mesh", mesh]
                               + (["--set", "domain.overlap=true"] if overlap else []),
                               strategy="domain"))
    steps.append(_step(tmp, "dom-single", None, ["--strategy", "domain"], strategy="domain"))
    for name, (flavour, extra) in FLAVOURS.items():
        steps.append(_step(tmp, name, 4, _composed(flavour, extra),
                           strategy=f"domain+{flavour}"))
    # a domain checkpoint read at another decomposition and by one process
    ck = str(tmp / "ck")
    steps.append(_step(tmp, "save", 2, ["--strategy", "domain", "--mesh", "dom=2",
                                        "--checkpoint-dir", ck], steps=10))
    resume = ["--resume", f"{ck}/ckpt-000010.h5"]
    for name, world, extra in [("to-2x2", 4, ["--strategy", "domain", "--mesh", "dp=2,dom=2"]),
                               ("to-single", None, [])]:
        steps.append(_step(tmp, name, world, extra + resume + ["--checkpoint-dir",
                                                                str(tmp / name)],
                           after=["save"]))
    # written by domain+zero3 at 4 ranks, read by single, zero2 at 2 ranks and domain+fsdp
    ckc = str(tmp / "ck-composed")
    steps.append(_step(tmp, "save-composed", 4, _composed("zero3", ["--checkpoint-dir", ckc]),
                       steps=10))
    resume = ["--resume", f"{ckc}/ckpt-000010.h5"]
    for name, world, extra in [("c-single", None, []), ("c-zero2", 2, ["--strategy", "zero2"]),
                               ("c-fsdp", 4, _composed("fsdp", []))]:
        steps.append(_step(tmp, name, world, extra + resume + ["--checkpoint-dir",
                                                                str(tmp / name)],
                           after=["save-composed"]))
    # its pretend ranks-per-node a process fixes once: a launch of its own
    return steps + [_step(tmp, "fsdp-HYBRID_SHARD", 4, _composed(*HYBRID),
                          strategy=f"domain+{HYBRID[0]}",
                          launch_env={"HPCTRAIN_RANKS_PER_NODE": "2"})]


pool(__name__, lambda tmp: train_steps(_table(tmp)))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res = pooled_results(__name__, tmp_path_factory)
    return {**res, "_rows": {r.id: r for r in _table(res["_tmp"])}}


def _follows_single(results, cid):
    assert_case(results, results["_rows"][cid])


@pytest.mark.parametrize("name", MESHES)
def test_domain_matches_single(results, name):
    _follows_single(results, "dom-single" if MESHES[name][0] is None else name)


def test_domain_checkpoint_resumes_elsewhere(results):
    for name in ("to-2x2", "to-single"):
        _follows_single(results, name)


@pytest.mark.parametrize("name", [*FLAVOURS, "fsdp-HYBRID_SHARD"])
def test_domain_composes_with_every_dp_flavour(results, name):
    _follows_single(results, name)


def test_composed_checkpoint_resumes_under_other_plans(results):
    """Written by domain+zero3 at 4 ranks, read by single, by zero2 at 2 ranks and by
    domain+fsdp: each continues the single-process trajectory."""
    for name in ("c-single", "c-zero2", "c-fsdp"):
        _follows_single(results, name)
