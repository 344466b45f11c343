"""Mesh layouts (pure) and the sub-communicators they build (under mpirun)."""

import os

import re

import pytest

from hpctrain.runtime.mesh import DIMS, MeshLayout
from tests.mpirun import run_mpi

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("text, world, expect", [
    ("", 4, dict(pp=1, dp=4, dom=4 // 4, tp=1)),
    ("dp=2,pp=2", 4, dict(pp=2, dp=2, dom=1, tp=1)),
    ("pp=2", 8, dict(pp=2, dp=4, dom=1, tp=1)),
    ("dom=2x2", 4, dict(pp=1, dp=1, dom=4, tp=1)),
    ("dp=2,dom=2", 4, dict(pp=1, dp=2, dom=2, tp=1)),
    ("tp=2,dp=-1", 6, dict(pp=1, dp=3, dom=1, tp=2)),
])
def test_layout_resolves(text, world, expect):
    # every other registered key (a dimension added later) stays at 1
    assert MeshLayout.parse(text).resolve(world).degrees() == {**dict.fromkeys(DIMS, 1),
                                                               **expect}


@pytest.mark.parametrize("text, world, words", [
    ("dp=3", 4, ["dp=3", "world size 4", "multiply to 3"]),
    ("pp=3", 4, ["pp=3", "does not divide"]),
    ("dp=-1,pp=-1", 4, ["at most one"]),
    ("dp=0", 4, ["positive"]),
    ("xp=2", 4, ["bad entry", "pp, dp, dom, tp"]),
    ("dp=two", 4, ["not an integer"]),
    ("dp=2,dp=2", 4, ["given twice"]),
    ("pp=2x2", 4, ["only dom"]),
])
def test_layout_errors_name_every_degree(text, world, words):
    with pytest.raises(ValueError) as err:
        MeshLayout.parse(text).resolve(world)
    for w in words:
        assert w in str(err.value)


def test_error_message_lists_all_degrees():
    with pytest.raises(ValueError) as err:
        MeshLayout.parse("dp=2,pp=3,tp=1").resolve(4)
    for w in ("pp=3", "dp=2", "dom=1", "tp=1", "world size 4"):
        assert w in str(err.value)


LAYOUTS = [(4, "dp=2,pp=2"), (4, "tp=2,dp=2"), (4, "dom=2x2"), (2, "")]


@pytest.fixture(scope="module")
def mesh_runs():
    """{world size: the output of one launch checking all that size's layouts}: one process
    start per world size, not per layout (mesh_worker.py, one layout after another)."""
    return {n: run_mpi(n, [os.path.join(HERE, "mesh_worker.py"),
                           *[lay for m, lay in LAYOUTS if m == n]], timeout=120).stdout
            for n in dict.fromkeys(n for n, _ in LAYOUTS)}


@pytest.mark.mpi
@pytest.mark.parametrize("n, layout", LAYOUTS)
def test_mesh_subcommunicators(mesh_runs, n, layout):
    # matched anywhere: mpirun may join two ranks' lines
    ranks = re.findall(rf"mesh ok {re.escape(repr(layout))} (\d+) ", mesh_runs[n])
    assert sorted(map(int, ranks)) == list(range(n)), mesh_runs[n]
