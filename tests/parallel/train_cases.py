"""Run many ``hpctrain train`` command lines per launch (tests/parallel/train_worker.py).

A step is {"id", "world", "argv" | "script" (+ "args"), "env"?, "launch_env"?, "after"?}:
``world`` None is one plain process (as ``run_single``), an int is ``mpirun -n world`` (as
``run_mpi``); ``argv`` are the flags after ``train`` (a leading ``-m hpctrain train`` is
dropped), ``script`` a worker script run in the same process instead, ``args`` its command
line; ``env`` is set for that step only, ``launch_env`` for its whole launch (a launch of
its own); ``after`` names steps that must have finished first (a checkpoint written by one
world size, resumed by another).

Test modules share launches through the session's pool: ``pool(__name__, build)`` at import
registers ``build(tmp) -> steps``; the first ``pooled_results`` of the session runs the steps
of every module with a selected test (``select_pooled``, from tests/conftest.py) together,
so the whole suite pays one process start per world size instead of one per module.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ThreadPoolExecutor

from tests.mpirun import run_mpi, run_single

__all__ = ["train_argv", "run_steps", "pool", "pooled_script", "pooled_results", "select_pooled",
           "script_step", "script_output"]

WORKER = ["-m", "tests.parallel.train_worker"]


def train_argv(args) -> list[str]:
    """The flags after ``train`` of a ``-m hpctrain train ...`` argument list."""
    args = list(args)
    if args[:3] == ["-m", "hpctrain", "train"]:
        return args[3:]
    return args


def _launch(tmp, tag, world, steps, mpi_env, timeout):
    cases = [{"id": s["id"], "script": s["script"], "args": s.get("args", [])}
             if "script" in s else
             {"id": s["id"], "argv": train_argv(s["argv"]), "env": s.get("env", {})}
             for s in steps]
    cases_path, out = tmp / f"cases-{tag}.json", tmp / f"out-{tag}.json"
    cases_path.write_text(json.dumps(cases))
    args = WORKER + [str(out), str(cases_path)]
    if world is None:
        run_single(args, env=mpi_env, timeout=timeout)
    else:
        run_mpi(world, args, env=mpi_env, timeout=timeout)
    return json.loads(out.read_text())


def _key(s):
    """The launch a step runs in: its world size and its launch environment (a process fixes
    some settings once, e.g. HPCTRAIN_RANKS_PER_NODE)."""
    return s["world"], tuple(sorted(s.get("launch_env", {}).items()))


def _plan(steps, keys, done):
    """The batch of each launch key in ``keys``, run one after another: every pending step of
    that key whose ``after`` steps are done or planned before it."""
    planned, batches = set(done), []
    for key in keys:
        batch = []
        for s in steps:
            if s["id"] in planned or _key(s) != key:
                continue
            if all(a in planned for a in s.get("after", ())):
                batch.append(s)
                planned.add(s["id"])
        if batch:
            batches.append((key, batch))
    return batches


def run_steps(tmp, steps, order=None, mpi_env=None, timeout=900) -> dict:
    """Run every step; return {id: {"rc", "summary", "stdout", "stderr"}} (rank 0's).

    Launches go through ``order`` (world sizes; default: None first, then by size), again
    and again until all is done; each launch runs every pending step of its world size
    whose ``after`` steps are done, earlier in the same launch included (list steps after
    those they wait on). The one-process launches (world None) run alongside the mpirun
    ones, which leave a core idle less often than one process does: a one-process step
    waits for MPI steps of an earlier round only, an MPI step for the one-process steps of
    an earlier round. ``mpi_env`` is added to the environment of every mpirun launch (e.g.
    HPCTRAIN_RANKS_PER_NODE, which a process fixes once); a step's own "launch_env" puts
    it in a launch of its own with those variables.
    """
    by_id = {s["id"]: s for s in steps}
    assert len(by_id) == len(steps), "step ids must be unique"
    worlds = list(dict.fromkeys(s["world"] for s in steps))
    if order is None:
        order = sorted(worlds, key=lambda w: -1 if w is None else w)
    order = list(order) + [w for w in worlds if w not in order]
    keys = list(dict.fromkeys(_key(s) for w in order for s in steps if s["world"] == w))
    done, results, launches = set(), {}, itertools.count(1)

    def launch(key, batch):
        world, env = key
        tag = f"{next(launches)}-{world}" + ("-env" if env else "")
        env = dict(env) if world is None else {**(mpi_env or {}), **dict(env)}
        return _launch(tmp, tag, world, batch, env, timeout)

    def lane(batches):
        out = {}
        for key, batch in batches:
            out.update(launch(key, batch))
        return out

    while len(done) < len(steps):
        single = _plan(steps, [k for k in keys if k[0] is None], done)
        multi = _plan(steps, [k for k in keys if k[0] is not None], done)
        assert single or multi, f"steps wait on each other: {sorted(set(by_id) - done)}"
        if single and multi:
            with ThreadPoolExecutor(1) as pool:
                side = pool.submit(lane, single)
                results.update(lane(multi))
                results.update(side.result())
        else:
            results.update(lane(single or multi))
        done |= {s["id"] for _, batch in single + multi for s in batch}
    return results


# ---- the session's pool ----------------------------------------------------------------

POOL: dict[str, tuple] = {}  # module -> (build(tmp) -> steps, the fixture that reads them)
_SELECTED: set[str] | None = None  # modules whose selected tests use that fixture
_RESULTS: dict[str, dict] = {}
_FAILED: dict[str, BaseException] = {}  # a failed pool fails each of its modules, once run
POOL_TIMEOUT = 1800  # one launch runs every module's steps of its world size


def pool(module: str, build, fixture: str = "results") -> None:
    """Put ``build``'s steps of ``module`` in the session's pool (call at import)."""
    POOL[module] = (build, fixture)


def pooled_script(module: str, script: str, worlds, fixture: str = "runs"):
    """Pool the worker ``script`` once at each world size in ``worlds`` (steps ``n{world}``)
    and return ``module``'s fixture of the results (assign it to ``fixture``'s name)."""
    import pytest

    pool(module, lambda tmp: [{"id": f"n{n}", "world": n, "script": script} for n in worlds],
         fixture)

    @pytest.fixture(scope="module", name=fixture)
    def results(tmp_path_factory):
        return pooled_results(module, tmp_path_factory)

    return results


def select_pooled(items) -> None:
    """Pool only the modules with a selected test that uses their fixture (-k, one file)."""
    global _SELECTED
    _SELECTED = {it.module.__name__ for it in items if getattr(it, "module", None) is not None
                 and it.module.__name__ in POOL and POOL[it.module.__name__][1] in
                 getattr(it, "fixturenames", ())}


def pooled_results(module: str, tmp_path_factory) -> dict:
    """``module``'s results as ``run_steps`` gives them (plus "_tmp", its build's folder); the
    first call runs every selected module's steps. Script steps go last in their launches
    (a script may wrap models by hand)."""
    if module in _FAILED:
        raise _FAILED[module]
    if module not in _RESULTS:
        names = [m for m in POOL if m not in _RESULTS and m not in _FAILED
                 and (_SELECTED is None or m in _SELECTED)]
        names = names if module in names else names + [module]
        steps, scripts, tmps = [], [], {}
        for m in names:
            tmps[m] = tmp_path_factory.mktemp(m.rsplit(".", 1)[-1])
            for s in POOL[m][0](tmps[m]):
                s = {**s, "id": f"{m}:{s['id']}",
                     "after": [f"{m}:{a}" for a in s.get("after", ())]}
                (scripts if "script" in s else steps).append(s)
        # The same command line in the same kind of launch is one run (modules share their
        # one-process references); a path of a module's own folder keeps its steps apart.
        first, same = {}, {}
        for s in steps:
            key = json.dumps([s["world"], s["argv"], s.get("env", {}), s.get("launch_env", {}),
                              s["after"]])
            same[s["id"]] = first.setdefault(key, s["id"])
        steps = [{**s, "after": [same.get(a, a) for a in s["after"]]} for s in steps + scripts
                 if same.get(s["id"], s["id"]) == s["id"]]
        try:
            out = run_steps(tmp_path_factory.mktemp("pool"), steps, timeout=POOL_TIMEOUT)
        except BaseException as e:
            _FAILED.update(dict.fromkeys(names, e))
            raise
        for sid, src in same.items():
            out[sid] = out[src]
        for m in names:
            _RESULTS[m] = {"_tmp": tmps[m]}
        for sid, r in out.items():
            m, _, cid = sid.partition(":")
            _RESULTS[m][cid] = r
    return _RESULTS[module]


def script_step(tmp, tag: str, world, script: str, cases, args=None, **extra) -> dict:
    """A pool step running a JSON-cases worker ``script`` (``script CASES OUT`` unless
    ``args`` orders them otherwise, e.g. ``["{out}", "{cases}"]``); read its rank 0's output
    with ``script_output``."""
    cases_path, out = tmp / f"{tag}-cases.json", tmp / f"{tag}-out.json"
    cases_path.write_text(json.dumps(cases))
    argv = [a.format(cases=cases_path, out=out) for a in (args or ["{cases}", "{out}"])]
    return {"id": tag, "world": world, "script": script, "args": argv, **extra}


def script_output(results: dict, tag: str) -> dict:
    return json.loads((results["_tmp"] / f"{tag}-out.json").read_text())
