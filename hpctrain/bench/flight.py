"""``bench flight``: what the flight recorder costs per training step (target: at most 1%).

Run it under the launcher (``mpirun -n 2 python -m hpctrain bench flight``). One Trainer
(the watchdog running, as in training) alternates blocks of steps with the recorder on and off,
so a machine shared with other jobs slows both alike; each rank takes the median step time
per mode and the slowest rank counts. A second, noise-free figure: the recorder's own cost per
op (timed in a tight loop) times the ops per step, over the step time.
"""

from __future__ import annotations

import mmap
import statistics
import time

import torch

__all__ = ["run"]


def _per_op_cost_s(n: int = 20000) -> float:
    """Seconds the wrapper adds to one op: argument sizing, start and end of an entry, the
    mirror write."""
    from hpctrain.runtime.comm.base import _op_size
    from hpctrain.runtime.flight import MIRROR_SIZE, FlightRecorder

    rec, t, args = FlightRecorder(), torch.ones(1024), (torch.ones(1024),)
    rec.mirror = mmap.mmap(-1, MIRROR_SIZE)  # as under the watchdog
    t0 = time.perf_counter()
    for _ in range(n):
        nbytes, dtype, peer = _op_size("allreduce", args, {})
        rec.end(rec.start("dp[0,1]", "allreduce", nbytes, dtype, peer))
    del t
    return (time.perf_counter() - t0) / n


def run(strategy: str = "zero3", model: str = "gpt", steps: int = 10, blocks: int = 8,
        batch: int = 16) -> int:
    # blocks: a multiple of 4 keeps the ABBA order balanced
    """Time ``blocks`` alternating blocks of ``steps`` steps (recorder on, off, on, ...);
    print the step-time ratio on/off and the per-op estimate (rank 0). Collective."""
    from hpctrain.config import Config
    from hpctrain.runtime.flight import RECORDER
    from hpctrain.runtime.world import init_world
    from hpctrain.train.trainer import Trainer

    world = init_world(device="cpu")
    cfg = Config()
    cfg.train.strategy, cfg.train.model, cfg.train.out_dir = strategy, model, ""
    cfg.train.global_batch_size, cfg.train.steps, cfg.train.progress = batch, 10**6, "off"
    trainer = Trainer(cfg, world)
    times: dict[bool, list[float]] = {True: [], False: []}
    ops: list[int] = []
    step = 0
    for b in range(blocks + 1):  # block 0 warms up (allocations, first-touch), not counted
        on = (b - 1) % 4 in (0, 3)  # on, off, off, on, ...: cancels a block-order effect
        RECORDER.enabled = on
        world.host.barrier()
        for _ in range(steps):
            c0 = RECORDER.count
            t0 = time.perf_counter()
            trainer._train_step(step)
            world.host.allreduce_scalars([0.0])  # the loop's loss reduction
            if b:
                times[on].append(time.perf_counter() - t0)
                if on:
                    ops.append(RECORDER.count - c0)
            step += 1
    RECORDER.enabled = True
    med_on, med_off, min_on, min_off = world.host.allreduce_scalars(
        [statistics.median(times[True]), statistics.median(times[False]), min(times[True]),
         min(times[False])], op="max")
    cost = _per_op_cost_s()
    per_step = statistics.median(ops) if ops else 0
    if trainer.watchdog is not None:
        trainer.watchdog.stop()
    if world.rank == 0:
        print(f"bench flight: {strategy}, model {model}, {world.size} ranks, global batch "
              f"{batch}, {blocks // 2} blocks of {steps} steps per mode")
        print(f"  step time: recorder on {med_on * 1e3:.2f} ms, off {med_off * 1e3:.2f} ms, "
              f"ratio {med_on / med_off:.4f} (target <= 1.01; noise on a shared machine "
              f"is a few %); fastest step: on {min_on * 1e3:.2f} ms, off {min_off * 1e3:.2f} "
              f"ms, ratio {min_on / min_off:.4f}")
        print(f"  recorder cost: {cost * 1e6:.2f} us/op x {per_step:.0f} ops/step = "
              f"{cost * per_step * 1e3:.3f} ms/step = {cost * per_step / med_off:.4%} of a step")
    world.host.barrier()
    return 0
