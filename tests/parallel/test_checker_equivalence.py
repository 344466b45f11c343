"""The equivalence checker (tests/parallel/equivalence.py) fails on each thing it checks, and
its step builders give the pool the rows as written. No launch: milliseconds."""

import pytest

from tests.parallel.equivalence import (Case, assert_case, assert_matches, summary,
                                        train_steps, worker_steps)

REF = {"strategy": "single", "world_size": 1, "trained_steps": 4, "losses": [4.0, 3.0, 2.0, 1.0],
       "param_norm": 10.0, "buffer_norm": 2.0}


def _got(**kw):
    return {**REF, "strategy": "zero3", "world_size": 2, **kw}


def test_a_match_passes():
    assert_matches(_got(losses=[4.00003, 3.0, 2.0, 1.0]), REF, 4, 2, "zero3")
    assert_matches(_got(strategy="pipeline+tensor"), REF, 4, 2, "*tensor*")


@pytest.mark.parametrize("got, kw", [
    (_got(losses=[4.0, 3.0, 2.0, 1.00002]), {}),                   # rtol 1e-5 on losses
    (_got(param_norm=10.0002), {}),
    (_got(buffer_norm=2.0001), {}),
    (_got(losses=[4.0, 3.0, 2.0]), {}),                             # step count
    (_got(strategy="zero2"), {}),
    (_got(world_size=4), {}),
    (_got(strategy="pipeline"), {"strategy": "*tensor*"}),
    (_got(losses=[4.0, 3.0, 2.00004, 9.0]), {"prefix": True, "steps": 3}),
    (_got(trained_steps=0), {"prefix": True}),
])
def test_each_difference_fails(got, kw):
    kw = {"steps": 4, "world": 2, "strategy": "zero3", **kw}
    with pytest.raises(AssertionError):
        assert_matches(got, REF, **kw)


def test_keys_and_prefix_limit_what_is_compared():
    assert_matches(_got(buffer_norm=3.0), REF, 4, 2, "zero3", keys=("losses", "param_norm"))
    # a run resumed and stopped early: its first 3 losses, not its length
    assert_matches(_got(losses=[4.0, 3.0, 2.0]), REF, 3, 2, "zero3", keys=("losses",),
                   prefix=True)


def test_assert_case_reads_rc_and_the_reference_row():
    results = {"ref": {"rc": 0, "summary": REF, "stdout": "", "stderr": ""},
               "a": {"rc": 0, "summary": _got(), "stdout": "", "stderr": ""},
               "b": {"rc": 2, "summary": None, "stdout": "", "stderr": "hpctrain: error: x"}}
    got, ref = assert_case(results, Case("a", 2, [], ref="ref", steps=4, strategy="zero3"))
    assert got["world_size"] == 2 and ref is REF
    with pytest.raises(AssertionError, match="hpctrain: error: x"):
        summary(results, "b")


def test_step_builders(tmp_path):
    rows = [Case("r", None, ["--steps", "4"]),
            Case("c", 2, ["--strategy", "ddp"], ref="r", env={"A": "1"}, after=("r",),
                 launch_env={"B": "2"})]
    assert train_steps(rows) == [
        {"id": "r", "world": None, "argv": ["--steps", "4"]},
        {"id": "c", "world": 2, "argv": ["--strategy", "ddp"], "env": {"A": "1"},
         "launch_env": {"B": "2"}, "after": ["r"]}]
    rows = [Case("r", None, {"train": {}}), Case("c", 4, {"train": {"x": 1}}, ref="r")]
    steps = worker_steps(tmp_path, "w.py", rows, id_key="name", launch_env={4: {"B": "2"}})
    assert [(s["id"], s["world"], s.get("launch_env")) for s in steps] == [
        ("single", None, None), ("four", 4, {"B": "2"})]
    assert (tmp_path / "four-cases.json").read_text() == '[{"name": "c", "train": {"x": 1}}]'
