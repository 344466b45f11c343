"""Run many configurations in ONE process group (amortises start-up); rank 0 writes JSON.

usage: python -m tests.parallel.pipeline_zero_worker CASES_JSON OUT_JSON
Cases as for pipeline_worker; a case with "memory": true also records every rank's
memory_report() and how many full parameter gradients are alive after the last step and
after each step's schedule (before the optimizer step).
"""

import json
import sys

from hpctrain.runtime.world import init_world
from hpctrain.train.trainer import Trainer, build_model
from tests.parallel.pipeline_worker import make_config


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    world = init_world()
    out = {}
    for case in cases:
        cfg = make_config(case)
        cfg.validate(world.size)
        trainer = Trainer(cfg, world=world, built=build_model(cfg, world.size))
        after_fb = []
        if case.get("memory"):  # full gradients alive when the schedule is done, per step
            par, run = trainer.par, trainer.par.forward_backward

            def counted(*args, **kw):
                out = run(*args, **kw)
                after_fb.append(sum(p.grad is not None for p in par.model.parameters()))
                return out
            par.forward_backward = counted
        s = trainer.fit()
        rec = {k: s[k] for k in ("losses", "param_norm", "buffer_norm", "strategy")}
        if case.get("memory"):
            par = trainer.par
            live = sum(p.grad is not None for p in par.model.parameters())
            rec["memory"] = world.mpi_comm.allgather({**par.memory_report(),
                                                      "full_grads_alive": live,
                                                      "full_grads_after_schedule": after_fb})
        out[case["name"]] = rec
        world.host.barrier()
    if world.rank == 0:
        with open(sys.argv[2], "w") as fh:
            json.dump(out, fh)


if __name__ == "__main__":
    main()
