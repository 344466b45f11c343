"""Run many ``hpctrain train`` command lines per launch (tests/parallel/train_worker.py).

A step is {"id", "world", "argv" | "script", "env"?, "after"?}: ``world`` None is one plain
process (as ``run_single``), an int is ``mpirun -n world`` (as ``run_mpi``); ``argv`` are the
flags after ``train`` (a leading ``-m hpctrain train`` is dropped), ``script`` a worker
script run in the same process instead; ``env`` is set for that step only; ``after`` names
steps that must have finished first (a checkpoint written by one world size, resumed by
another).
"""

from __future__ import annotations

import json

from tests.mpirun import run_mpi, run_single

__all__ = ["train_argv", "run_steps"]

WORKER = ["-m", "tests.parallel.train_worker"]


def train_argv(args) -> list[str]:
    """The flags after ``train`` of a ``-m hpctrain train ...`` argument list."""
    args = list(args)
    if args[:3] == ["-m", "hpctrain", "train"]:
        return args[3:]
    return args


def _launch(tmp, tag, world, steps, mpi_env, timeout):
    cases = [{"id": s["id"], "script": s["script"]} if "script" in s else
             {"id": s["id"], "argv": train_argv(s["argv"]), "env": s.get("env", {})}
             for s in steps]
    cases_path, out = tmp / f"cases-{tag}.json", tmp / f"out-{tag}.json"
    cases_path.write_text(json.dumps(cases))
    args = WORKER + [str(out), str(cases_path)]
    if world is None:
        run_single(args, timeout=timeout)
    else:
        run_mpi(world, args, env=mpi_env, timeout=timeout)
    return json.loads(out.read_text())


def run_steps(tmp, steps, order=None, mpi_env=None, timeout=900) -> dict:
    """Run every step; return {id: {"rc", "summary", "stdout", "stderr"}} (rank 0's).

    Launches go through ``order`` (world sizes; default: in order of first appearance),
    again and again until all is done; each launch runs every pending step of its world size
    whose ``after`` steps are done, earlier in the same launch included (list steps after
    those they wait on). ``mpi_env`` is added to the environment of every mpirun launch
    (e.g. HPCTRAIN_RANKS_PER_NODE, which a process fixes once).
    """
    by_id = {s["id"]: s for s in steps}
    assert len(by_id) == len(steps), "step ids must be unique"
    if order is None:
        order = list(dict.fromkeys(s["world"] for s in steps))
    done, results, launches = set(), {}, 0
    while len(done) < len(steps):
        progressed = False
        for world in order:
            batch, planned = [], set(done)
            for s in steps:
                if s["id"] in planned or s["world"] != world:
                    continue
                if all(a in planned for a in s.get("after", ())):
                    batch.append(s)
                    planned.add(s["id"])
            if not batch:
                continue
            launches += 1
            results.update(_launch(tmp, f"{launches}-{world}", world, batch, mpi_env, timeout))
            done |= {s["id"] for s in batch}
            progressed = True
        assert progressed, f"steps wait on each other: {sorted(set(by_id) - done)}"
    return results
