"""Pipeline bubble and throughput: hpctrain's schedules vs the formula and torch pipelining.

Run under mpirun with at least max(--pp) ranks, e.g. ``mpirun -n 4 python -m hpctrain bench
pipeline``. For each pipeline depth p the first p ranks form the pipeline (the rest sleep
without spinning). The model is ``layers`` identical layers, so a balanced split gives every
stage the same work and the formula applies as written:

- ``--model linear`` (default): Linear+GELU layers, real compute.
- ``--model timed``: layers that busy-wait a fixed wall-clock time (``--layer-ms`` forward,
  twice that backward) on real (micro-batch, width) tensors with a per-feature trainable
  scale (hpctrain/bench/timed_layer.py). Equal FLOPs do not make equal stages when the
  host's vCPUs drift in speed independently (+-20% over seconds on a shared VM): the
  linear model's bubble then mostly measures that imbalance. Timed stages are equal by
  construction (the last layer and the loss share one layer's time, so the stage that
  computes the loss is no longer), so the measured bubble isolates what the implementation
  adds: p2p messages (same sizes as the linear model's), Python bookkeeping and wake-ups
  all stay; real compute-speed variation and memory effects (cache, bandwidth) are left
  out. The wait spins rather than sleeps, so a core shared with another process still
  shows; ``--layer-sleep`` sleeps instead, as a GPU stage's host core idles, so p can
  exceed the cores.

Measured bubble of a stage = (its idle time) / (step span): idle is the time it is blocked
waiting for a neighbour (timestamps around every blocking receive) plus the time from its
last compute to the end of the step; the span runs from a common barrier to the end of the
last compute of any stage. Formula: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1). The table
also shows the overhead: the rest of the span that is neither compute (forward/backward
intervals) nor waiting -- Python and p2p bookkeeping that the formula counts as zero.

The formula assumes equal stages and free communication. To tell which assumption a run
broke, the schedule simulator replays every step with the measured compute times: once with
each stage at its median forward/backward time (``sim``; sim - formula = stage imbalance)
and once with every action at its own time (adds jitter, e.g. a rank preempted mid-layer);
what remains of the measured bubble is communication: message latency and wake-ups. The
default micro-batch (128 x 512) keeps a stage's compute per micro-batch tens of times above
the p2p time of one activation, as in a real pipeline; tiny micro-batches measure latency.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.bench.cores import idle_barrier, shared_cores
from hpctrain.bench.gloo_group import init_gloo
from hpctrain.parallel.pipeline import schedule as sched_

__all__ = ["run", "bench_model", "MODELS"]

MODELS = ("linear", "timed")


def bench_model(layers: int, width: int, seed: int = 0, model: str = "linear",
                layer_ms: float = 0.5, layer_sleep: bool = False):
    """A LayerStack of ``layers`` identical layers, Linear+GELU or TimedLayers of ``layer_ms``
    forward (sleeping rather than spinning with ``layer_sleep``), and its MSE loss (the same
    modules serve torch pipelining's nn.Sequential). The timed model's last layer and loss
    share the layer's fixed time, so the last stage, which alone computes the loss, is no
    longer than the others."""
    from hpctrain.bench.timed_layer import TailClock, TimedLayer, timed_mse_loss
    from hpctrain.models.layers import LayerStack, PipeLayer, seeded

    clock = TailClock(layer_sleep) if model == "timed" else None

    def module(i):
        if model == "timed":
            return TimedLayer(width, layer_ms / 1e3, clock if i == layers - 1 else None,
                              layer_sleep)
        return nn.Sequential(nn.Linear(width, width), nn.GELU())

    def layer(i):
        def build():
            return seeded(seed, i, lambda: {str(i): module(i)})
        return PipeLayer(str(i), build, lambda root, x, i=i: root.get_submodule(str(i))(x))

    loss = timed_mse_loss(clock, layer_ms / 1e3) if clock is not None else F.mse_loss
    return LayerStack([layer(i) for i in range(layers)]), loss


def _describe(model: str, layers: int, width: int, layer_ms: float, sleep: bool) -> str:
    if model == "timed":
        return (f"{layers} x timed layer ({layer_ms:.2f} ms fwd / {2 * layer_ms:.2f} ms bwd, "
                f"width {width}, {'sleeping' if sleep else 'spinning'}; the last one's time "
                f"includes the loss)")
    return f"{layers} x Linear({width})+GELU"


def _sub_world(world, p):
    """A World over the first p ranks (None on the others)."""
    from hpctrain.runtime.comm.mpi import MPICommunicator
    from hpctrain.runtime.world import World

    sub = world.mpi_comm.Split(0 if world.rank < p else 1, world.rank)
    if world.rank >= p:
        sub.Free()
        return None
    c = MPICommunicator(sub, owned=True)
    return World(launch=world.launch, mpi_comm=sub, host=c, comm=c, node=c, cross=c,
                 device=torch.device("cpu"))


def _hpctrain(sub, schedule, p, m, v, make_model, width, micro, steps, warmup, waits,
              p2p="eager"):
    """Per wait policy: measured bubble and overhead per stage, median step time, and the
    breakdown (rank 0). The policies take turns step by step, so they share the load."""
    from hpctrain.parallel import wrap
    from hpctrain.parallel.pipeline import PipelineOptions
    from hpctrain.train.precision import Precision

    stack, loss = make_model()
    opts = PipelineOptions(mesh=f"pp={p},dp=1", schedule=schedule, microbatches=m,
                           virtual_stages=v, p2p=p2p)
    with contextlib.redirect_stdout(io.StringIO()):
        par = wrap("pipeline", stack, lambda ps: torch.optim.SGD(ps, lr=1e-4), sub, opts)
    prec = Precision("fp32", torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(m * micro, width, generator=g), torch.randn(m * micro, width, generator=g)
    links = par.executor.engine.links
    got = {w: ([], [], [], []) for w in waits}  # bubbles, overheads, step times, traces
    for step in range(warmup + steps * len(waits)):
        links.wait = waits[step % len(waits)]
        par.executor.engine.trace = []
        links.recv_wait = 0.0
        sub.host.barrier()
        t0 = time.perf_counter()
        par.forward_backward([(x, y, 1.0)], loss, prec)
        busy = sum(e - s for *_, s, e in par.executor.engine.trace)
        end = par.executor.engine.trace[-1][4] - t0
        span = sub.host.allreduce_scalars([end], op="max")[0]
        idle = links.recv_wait + (span - end)
        # every compute interval of every rank, for the simulator on rank 0
        mine = torch.tensor([[a == "B", mb, sched_.stage_of(sub.rank, c, p), s - t0, e - t0]
                             for a, mb, c, s, e in par.executor.engine.trace], dtype=torch.float64)
        trace = sub.host.allgather(mine)
        par.step()
        dt = sub.host.allreduce_scalars([time.perf_counter() - t0], op="max")[0]
        if step >= warmup:
            for acc, val in zip(got[links.wait], (idle / span,
                                                 max(0.0, 1 - (busy + idle) / span), dt, trace)):
                acc.append(val)
    out = {}
    for w, (bubbles, overheads, times, traces) in got.items():
        mine = torch.tensor([statistics.median(bubbles), statistics.median(overheads)],
                            dtype=torch.float64)
        per_stage = sub.host.allgather(mine.view(1, 2))
        out[w] = (per_stage[:, 0].tolist(), statistics.median(times), per_stage[:, 1].tolist(),
                  _breakdown(traces, schedule, p, m, v) if sub.rank == 0 else None)
    return out


def _breakdown(traces, schedule, p, m, v):
    """Per-stage median forward/backward seconds per micro-batch, and the bubble the schedule
    would have with free communication: with every stage at its median times (what unequal
    stages alone cost) and with every action at its measured time (adds their jitter);
    ``hop(latency)`` is the latter with every message taking ``latency``."""
    acts = sched_.build(schedule, p, m, v)
    med = statistics.median
    stage_f, stage_b, sim_stage, durs = [], [], [], []
    for tr in traces:
        dur = {("B" if b else "F", int(mb), int(g)): e - s for b, mb, g, s, e in tr.tolist()}
        durs.append(dur)
        fwd = [statistics.median(d for (op, _, gg), d in dur.items() if op == "F" and gg == g)
               for g in range(p * v)]
        bwd = [statistics.median(d for (op, _, gg), d in dur.items() if op == "B" and gg == g)
               for g in range(p * v)]
        stage_f.append(fwd)
        stage_b.append(bwd)
        sim_stage.append(_mean(sched_.simulate(
            acts, v, cost=lambda op, mb, g: fwd[g] if op == "F" else bwd[g])["bubble"]))

    def actual(latency: float) -> float:
        return med(_mean(sched_.simulate(acts, v, cost=lambda op, mb, g: d[(op, mb, g)],
                                         latency=latency)["bubble"]) for d in durs)

    return {"fwd": [med(s[g] for s in stage_f) for g in range(p * v)],
            "bwd": [med(s[g] for s in stage_b) for g in range(p * v)],
            "sim_stage": med(sim_stage), "sim_actual": actual(0.0), "hop": actual}


def _mean(xs):
    return sum(xs) / len(xs)


def _torch_pipelining(world, p, schedule, m, v, make_model, width, micro, steps, warmup):
    """Median step time of torch.distributed.pipelining on the same model (ranks < p)."""
    import torch.distributed as dist
    from torch.distributed import pipelining as tp

    group = dist.new_group(list(range(p)))  # collective over the whole world
    if world.rank >= p:
        return None
    stack, loss = make_model()
    per = len(stack) // (p * v)
    stages = []
    for c in range(v):
        g = c * p + world.rank
        mod = nn.Sequential(*[stack.layers[i].build()[str(i)] for i in range(g * per, (g + 1) * per)])
        stages.append(tp.PipelineStage(mod, g, p * v, torch.device("cpu"), group=group))
    if schedule == "gpipe":
        sch = tp.ScheduleGPipe(stages[0], m, loss_fn=loss)
    elif schedule == "1f1b":
        sch = tp.Schedule1F1B(stages[0], m, loss_fn=loss)
    else:
        sch = tp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    opt = torch.optim.SGD([q for s in stages for q in s.submod.parameters()], lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(m * micro, width, generator=g), torch.randn(m * micro, width, generator=g)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    times = []
    for step in range(warmup + steps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        args = (x,) if first else ()
        sch.step(*args, target=y if last else None)
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        if step >= warmup:
            times.append(float(dt))
    return statistics.median(times)


def run(pp=(2, 4), ms=(4, 8, 16), schedules=("gpipe", "1f1b", "interleaved-1f1b"), v: int = 2,
        layers: int = 16, width: int = 512, micro: int = 128, steps: int = 5, warmup: int = 2,
        torch_compare: bool = True, waits=("sleep",), model: str = "linear",
        layer_ms: float = 0.5, p2p: str = "eager", layer_sleep: bool = False) -> int:
    """Measure and print the bubble table (and throughput vs torch pipelining) on rank 0."""
    from hpctrain.parallel.pipeline.p2p import WAITS
    from hpctrain.parallel.pipeline.schedule import bubble_formula
    from hpctrain.runtime.world import init_world

    bad = [w for w in waits if w not in WAITS]
    if bad:  # before any MPI work, same message on every rank
        raise SystemExit(f"bench pipeline: --wait {','.join(bad)} is not one of {', '.join(WAITS)}")
    if model not in MODELS:
        raise SystemExit(f"bench pipeline: --model {model} is not one of {', '.join(MODELS)}")
    if p2p not in ("eager", "ordered"):
        raise SystemExit(f"bench pipeline: --p2p {p2p} is not one of eager, ordered")
    if layer_sleep and model != "timed":
        raise SystemExit("bench pipeline: --layer-sleep needs --model timed")
    if model == "timed" and not layer_ms > 0:
        raise SystemExit(f"bench pipeline: --layer-ms must be > 0, got {layer_ms}")
    make_model = functools.partial(bench_model, layers, width, model=model, layer_ms=layer_ms,
                                   layer_sleep=layer_sleep)
    world = init_world(device="cpu")
    pp = [p for p in pp if p <= world.size]
    if not pp:
        raise SystemExit(f"bench pipeline: needs at least {min(pp or [2])} ranks; "
                         f"run it under mpirun -n 4")
    rows, torch_err = [], ""
    load0 = os.getloadavg()[0]
    shared = shared_cores(world)
    latency = _p2p_latency(world, micro * width, waits[-1])
    if torch_compare:
        try:
            init_gloo(world)
        except Exception as exc:  # report why the comparison is missing, keep measuring ours
            torch_err = f"{type(exc).__name__}: {exc}"
    for p in pp:
        sub = _sub_world(world, p)
        for schedule in schedules:
            vv = v if schedule == "interleaved-1f1b" else 1
            for m in ms:
                if (schedule == "interleaved-1f1b" and m % p) or layers % (p * vv):
                    continue
                res = {}
                if sub is not None:
                    res = _hpctrain(sub, schedule, p, m, vv, make_model, width, micro,
                                    steps, warmup, waits, p2p)
                idle_barrier(world)
                tt = None
                if torch_compare and not torch_err:
                    try:
                        tt = _torch_pipelining(world, p, schedule, m, vv, make_model, width,
                                               micro, steps, warmup)
                    except Exception as exc:
                        torch_err = f"{type(exc).__name__}: {exc}"
                idle_barrier(world)
                for wait, r in res.items() if world.rank == 0 else ():
                    rows.append((schedule, p, m, vv, wait, r[0], bubble_formula(p, m, vv),
                                 m * micro / r[1], None if tt is None else m * micro / tt,
                                 sum(r[2]) / len(r[2]), r[3]))
        if sub is not None:
            sub.Free() if hasattr(sub, "Free") else None
    # The message time right after a stage's compute, which is what the schedule sees.
    least = min((min(r[-1]["fwd"]) for r in rows), default=0.0)
    least = world.host.allreduce_scalars([least], op="max")[0]
    hop = _p2p_latency(world, micro * width, waits[-1], busy=least, sleep=layer_sleep)
    if world.rank == 0:
        _print(rows, world.size,
               f"{_describe(model, layers, width, layer_ms, layer_sleep)}, p2p {p2p}",
               width, micro, steps,
               warmup, v, load0, shared, latency, hop, waits)
        if torch_compare and torch_err:
            print(f"torch.distributed.pipelining comparison did not run: {torch_err}")
    return 0


def _p2p_latency(world, numel: int, wait: str, reps: int = 50, busy: float = 0.0,
                 sleep: bool = False) -> float:
    """One-way time of one activation between ranks 0 and 1 (ping-pong median, seconds),
    received the way the engine receives (``wait`` policy). ``busy`` > 0: each side computes
    (spins, or sleeps with ``sleep``) that long before it sends, as a stage does; on a shared
    or virtualised host the first operations after a long compute run slower than back to
    back, so this is the message time a pipeline actually pays."""
    from hpctrain.bench.timed_layer import wait_until
    from hpctrain.runtime.comm.idle import wait_idle

    if busy > 0:
        reps = max(5, min(reps, int(1.0 / busy)))  # about a second of spinning at most

    buf = torch.zeros(numel)
    peer = 1 - world.rank

    def recv():
        if wait == "spin":
            world.host.recv(buf, peer, 7)
        else:
            wait_idle(world.host.irecv(buf, peer, 7))

    times = []
    for _ in range(reps if world.rank < 2 else 0):
        t0 = time.perf_counter()
        if world.rank == 0:
            wait_until(t0 + busy, sleep)
            world.host.send(buf, 1, 7)
            recv()
        else:
            recv()
            wait_until(time.perf_counter() + busy, sleep)
            world.host.send(buf, 0, 7)
        times.append((time.perf_counter() - t0) / 2 - busy)
    idle_barrier(world)
    return statistics.median(times) if times else 0.0


def _print(rows, size, model, width, micro, steps, warmup, v, load0, shared, latency, hop,
           waits) -> None:
    print(f"pipeline bench: {size} ranks, cpu, {model}, "
          f"micro-batch {micro}, median of {steps} steps after {warmup} warm-up, v={v}, "
          f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    if shared:
        print(f"  warning: {shared}; a busy neighbour slows the stages and the bubble grows")
    if rows:
        least = min(min(bd["fwd"]) for *_, bd in rows)
        print(f"  one activation ({micro}x{width} fp32, {micro * width * 4 // 1024} KiB) crosses a "
              f"stage boundary in {latency * 1e6:.0f} us back to back (ping-pong, wait "
              f"{waits[-1]}),\n  in {hop * 1e6:.0f} us when sent right after a compute of "
              f"{least * 1e3:.2f} ms (the shortest stage compute per micro-batch = "
              f"{least / max(latency, 1e-9):.0f}x the former)")
        if least < 20 * latency:  # messages are no longer a small fixed cost per step
            print("  warning: compute per micro-batch is within 20x of one message: the table "
                  "measures latency more than the schedule (raise --micro-batch or --width; "
                  "timed model: --layer-ms)")
    print("  bubble = idle share of the step span. sim = bubble the schedule would have with "
          "free communication and\n  every stage at its measured median fwd/bwd time; excess "
          "over formula = imbal (sim - formula: unequal\n  stages) + jitter (every action at its "
          "own measured time) + hop (every message taking the after-compute\n  time above) + "
          "comm (the rest: Python between actions, wake-ups, late sends); /sim = measured bubble "
          "over\n  sim: what the implementation adds to the schedule run at the stages' actual "
          "speeds")
    print(f"  {'schedule':<17}{'p':>2}{'m':>4}{'v':>3} {'wait':<6}"
          f"{'bubble per stage (measured)':<30}"
          f"{'mean':>7}{'formula':>9}{'ratio':>7}{'sim':>7}{'/sim':>6}{'imbal':>7}{'jitter':>7}{'hop':>7}{'comm':>7}"
          f"{'overhead':>9}{'samples/s':>11}{'torch':>9}{'ours/torch':>11}")
    for sched, p, m, vv, wait, per, formula, ours, theirs, over, bd in rows:
        mean = sum(per) / len(per)
        stages = " ".join(f"{b:.3f}" for b in per)
        t = f"{theirs:9.0f}{ours / theirs:11.2f}" if theirs else f"{'-':>9}{'-':>11}"
        sim, act, with_hop = bd["sim_stage"], bd["sim_actual"], bd["hop"](hop)
        print(f"  {sched:<17}{p:>2}{m:>4}{vv:>3} {wait:<6}{stages:<30}{mean:7.3f}{formula:9.3f}"
              f"{mean / formula:7.2f}{sim:7.3f}{mean / max(sim, 1e-9):6.2f}{sim - formula:+7.3f}"
              f"{act - sim:+7.3f}{with_hop - act:+7.3f}"
              f"{mean - with_hop:+7.3f}{over:9.3f}{ours:11.0f}{t}")
    print("  compute per micro-batch, median ms forward/backward of each stage (last: with loss):")
    for sched, p, m, vv, wait, *_, bd in rows:
        cells = " ".join(f"{f * 1e3:.2f}/{b * 1e3:.2f}" for f, b in zip(bd["fwd"], bd["bwd"]))
        print(f"  {sched:<17}{p:>2}{m:>4}{vv:>3} {wait:<6}{cells}")
