"""The equivalence tables' one row shape and their one checker.

Every parallelism's equivalence file writes its runs as ``Case`` rows: a reference row
(``ref`` None: one plain process, the trajectory to reproduce) or a case row (``ref`` names
the reference row it must follow). ``train_steps`` turns rows holding ``hpctrain train``
flags into the session pool's steps (tests/parallel/train_cases.py, many rows per launch);
``worker_steps`` turns rows holding a JSON-cases worker's case into one pool step per world
size. ``assert_case`` (``assert_matches`` on the two summaries) is the check every file
makes: the strategy and world size the run reports, its step count, and each compared key
within ``rtol`` (atol 0) of the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import numpy as np

from tests.parallel.train_cases import script_output, script_step

__all__ = ["KEYS", "STEPS", "Case", "assert_case", "assert_matches", "summary", "train_steps",
           "worker_results", "worker_steps"]

STEPS = 20
KEYS = ("losses", "param_norm", "buffer_norm")


@dataclass(frozen=True)
class Case:
    """One run of an equivalence table.

    ``world``: None is one plain process, n is ``mpirun -n n``. ``run``: the flags after
    ``hpctrain train`` (a list) or a JSON-cases worker's case (a dict, its id added by
    ``worker_steps``). ``ref``: the reference row this run must follow (None: it is one).
    ``strategy``: the strategy the summary must report (an fnmatch pattern, e.g. ``*tensor*``)
    with world size ``world or 1``; None checks neither. ``prefix``: the run is compared on
    its first ``steps`` losses only (resumed or stopped early), not on its length.
    """
    id: str
    world: int | None
    run: list | dict
    ref: str | None = None
    strategy: str | None = None
    steps: int = STEPS
    keys: tuple = KEYS
    rtol: float = 1e-5
    prefix: bool = False
    env: dict = field(default_factory=dict)
    launch_env: dict = field(default_factory=dict)
    after: tuple = ()


def train_steps(cases) -> list[dict]:
    """The pool steps ({id, world, argv, ...}) of rows holding ``hpctrain train`` flags."""
    steps = []
    for c in cases:
        s = {"id": c.id, "world": c.world, "argv": list(c.run)}
        if c.env:
            s["env"] = dict(c.env)
        if c.launch_env:
            s["launch_env"] = dict(c.launch_env)
        if c.after:
            s["after"] = list(c.after)
        steps.append(s)
    return steps


TAGS = {None: "single", 1: "one", 2: "two", 4: "four", 8: "eight"}


def worker_steps(tmp, script, cases, args=None, id_key="id", launch_env=None) -> list[dict]:
    """One pool step per world size running ``script`` (a JSON-cases worker) on its rows,
    each row's case with its id under ``id_key``; ``launch_env``: {world: env} for a launch
    of its own. Read them back with ``worker_results``."""
    worlds = list(dict.fromkeys(c.world for c in cases))
    return [script_step(tmp, TAGS[w], w, script,
                        [{id_key: c.id, **c.run} for c in cases if c.world == w], args,
                        **({"launch_env": launch_env[w]} if w in (launch_env or {}) else {}))
            for w in worlds]


def worker_results(results, cases) -> dict:
    """{id: summary} over the launches ``worker_steps`` made for ``cases``."""
    return {k: v for w in dict.fromkeys(c.world for c in cases)
            for k, v in script_output(results, TAGS[w]).items()}


def summary(results, cid) -> dict:
    """Run ``cid``'s summary; a ``train_worker`` result must have exited 0 (a worker
    script's result is the summary itself)."""
    r = results[cid]
    if "rc" in r and "summary" in r:
        assert r["rc"] == 0, (f"{cid}: rc {r['rc']}\n{r['stdout'][-2000:]}\n"
                              f"{r['stderr'][-4000:]}")
        return r["summary"]
    return r


def assert_matches(got, ref, steps=STEPS, world=None, strategy=None, rtol=1e-5, keys=KEYS,
                   name="", prefix=False) -> None:
    """Summary ``got`` reproduces reference summary ``ref``: it reports ``strategy`` (an
    fnmatch pattern; None: neither it nor ``world`` is checked) at ``world`` ranks, ran
    ``steps`` steps, and each of ``keys`` is within ``rtol`` (atol 0). ``prefix``: compare
    the first ``steps`` losses only (a resumed or shorter run), after at least one step."""
    if strategy is not None:
        assert fnmatchcase(got["strategy"], strategy) and got["world_size"] == world, (
            f"{name}: ran {got['strategy']!r} at {got['world_size']} ranks, expected "
            f"{strategy!r} at {world}")
    if prefix:
        assert got["trained_steps"] > 0, name
    else:
        assert len(got["losses"]) == steps, name
    for k in keys:
        a, b = got[k], ref[k]
        if prefix and k == "losses":
            a, b = a[:steps], b[:steps]
        np.testing.assert_allclose(a, b, rtol=rtol, atol=0, err_msg=f"{name} {k}")


def assert_case(results, case: Case) -> tuple[dict, dict]:
    """Row ``case`` follows its reference row in ``results``; return both summaries (got,
    ref) for a file's own further checks."""
    ref = summary(results, case.ref)
    got = summary(results, case.id)
    assert_matches(got, ref, case.steps, case.world or 1, case.strategy, case.rtol, case.keys,
                   case.id, case.prefix)
    return got, ref
