"""Run many configurations in ONE process group (amortises start-up); rank 0 writes JSON.

usage: python -m tests.parallel.pipeline_zero_worker CASES_JSON OUT_JSON
Cases as for pipeline_worker; a case with "memory": true also records every rank's
memory_report() and how many full parameter gradients are alive after the last step and
after each step's schedule (before the optimizer step).
"""

from tests.parallel.pipeline_worker import run_cases


def memory(case, trainer, world):
    """With "memory": count full gradients alive after each step's schedule, and record
    every rank's memory_report() after the run."""
    if not case.get("memory"):
        return None
    par, run, after_fb = trainer.par, trainer.par.forward_backward, []

    def counted(*args, **kw):
        out = run(*args, **kw)
        after_fb.append(sum(p.grad is not None for p in par.model.parameters()))
        return out
    par.forward_backward = counted

    def finish(rec):
        live = sum(p.grad is not None for p in par.model.parameters())
        rec["memory"] = world.mpi_comm.allgather({**par.memory_report(),
                                                  "full_grads_alive": live,
                                                  "full_grads_after_schedule": after_fb})
    return finish


if __name__ == "__main__":
    run_cases(memory)
