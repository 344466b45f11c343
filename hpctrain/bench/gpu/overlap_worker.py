"""One rank of the overlap measurement (``python -m hpctrain.bench.gpu.overlap_worker JSON``).

For each data-parallel flavour (built through ``hpctrain.parallel.wrap`` as
bench/workload.py does) on a stack of Linear layers:

* ``t_step``: a training step with its communication (the slowest rank's, median);
* ``t_compute``: the same forward, backward and AdamW step with no communication at all
  (workload.py's ``nocomm``), measured once for every flavour;
* ``t_comm``: the tensor collectives one step issued, read from the flight recorder (op,
  bytes, dtype) and replayed alone, one after another, on ``world.comm``.

Exposed communication = t_step - t_compute; overlap = 1 - exposed / t_comm. Rank 0 appends
one JSON line per flavour to ``out`` as soon as it is measured, so a run killed at its time
box still reports what it had.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from hpctrain.runtime.comm.base import BLOCKING_FORM, BLOCKING_OPS, NONBLOCKING_OPS

# The collectives replayed for t_comm: each recorded op -> its blocking form
REPLAY = {op: BLOCKING_FORM.get(op, op) for op in BLOCKING_OPS + NONBLOCKING_OPS
          if BLOCKING_FORM.get(op, op) in ("allreduce", "allgather", "reduce_scatter", "broadcast")}


def _sync(world) -> None:
    if world.device.type == "cuda":
        torch.cuda.synchronize(world.device)


def _timed_steps(par, x, world, steps: int) -> list[float]:
    """Each step's time on the slowest rank: synchronized (device, then ranks) around it."""
    from hpctrain.bench.workload import train_step

    times = []
    for _ in range(steps):
        _sync(world)
        world.mpi_comm.Barrier()
        t0 = time.perf_counter()
        train_step(par, x)
        _sync(world)
        times.append(time.perf_counter() - t0)
    return [max(ts) for ts in zip(*world.mpi_comm.allgather(times))]


def _step_ops(par, x, world) -> list[dict]:
    """The tensor collectives of one step, from the flight recorder: [{op, nbytes, dtype}]."""
    from hpctrain.bench.workload import train_step
    from hpctrain.runtime.flight import RECORDER

    RECORDER.enabled = True
    before = RECORDER.snapshot(last=1)["count"]
    train_step(par, x)
    _sync(world)
    n = RECORDER.snapshot(last=1)["count"] - before
    entries = [e for e in (RECORDER.snapshot(last=n)["entries"] if n > 0 else [])
               if e["op"] in REPLAY and e["nbytes"]]
    if world.comm is not world.host:
        # a device communicator that stages through the host may record its host ops too:
        # keep the device communicator's (the outer) ops only, so nothing is counted twice
        from hpctrain.runtime.flight import group_key

        host = group_key(world.host)
        outer = [e for e in entries if e["group"] != host]
        entries = outer or entries
    return [{"op": e["op"], "nbytes": e["nbytes"], "dtype": e["dtype"]} for e in entries]


def _replay(ops: list[dict], world, reps: int) -> list[float]:
    """t_comm: the step's collectives alone, on world.comm, the slowest rank's, per rep."""
    comm, n = world.comm, world.comm.size
    bufs = []
    for o in ops:
        dtype = getattr(torch, o["dtype"].replace("torch.", ""), torch.float32)
        elems = o["nbytes"] // torch.tensor([], dtype=dtype).element_size()
        if REPLAY[o["op"]] == "reduce_scatter":
            elems -= elems % n  # dim 0 divisible by the size, as the step's was
        bufs.append((REPLAY[o["op"]], torch.ones(max(elems, n), dtype=dtype,
                                                 device=world.device)))
    times = []
    for _ in range(reps):
        _sync(world)
        world.mpi_comm.Barrier()
        t0 = time.perf_counter()
        for op, buf in bufs:
            getattr(comm, op)(buf)
        _sync(world)
        times.append(time.perf_counter() - t0)
    return [max(ts) for ts in zip(*world.mpi_comm.allgather(times))]


def measure(cfg: dict) -> None:
    from hpctrain.bench.workload import ENTRIES, build_stack, train_step
    from hpctrain.runtime.world import init_world

    world = init_world(device=cfg["device"])
    main = world.rank == 0
    out = open(cfg["out"], "a") if main else None

    def emit(record: dict) -> None:
        if main:
            out.write(json.dumps(record) + "\n")
            out.flush()

    emit({"kind": "world", "comm": type(world.comm).__name__,
          "backend": getattr(world.comm, "backend", "?"), "device": str(world.device),
          "size": world.size})
    width, layers, batch = cfg["width"], cfg["layers"], cfg["batch"]
    warmup, steps = cfg["warmup"], cfg["steps"]
    g = torch.Generator().manual_seed(1 + world.rank)
    x = torch.randn(batch, width, generator=g).to(world.device)

    def build(name):
        model = build_stack(width, layers)
        if name == "nocomm":
            model.to(world.device)
        return ENTRIES[name].build(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), world)

    t_compute = None
    for name in ["nocomm", *cfg["flavours"]]:
        record = {"kind": "flavour", "name": name}
        try:
            par = build(name)
            for _ in range(warmup):
                train_step(par, x)
            step_times = _timed_steps(par, x, world, steps)
            record["t_step"] = statistics.median(step_times)
            record["step_times"] = step_times
            if name == "nocomm":
                t_compute = record["t_step"]
            else:
                ops = _step_ops(par, x, world)
                record["ops"] = _summarise(ops)
                del par
                record["t_comm"] = statistics.median(_replay(ops, world, cfg["reps"]))
                record["t_compute"] = t_compute
        except Exception as exc:  # the same on every rank (a build refusal): next flavour
            import traceback

            record["error"] = traceback.format_exc()[-3000:]
            print(f"rank {world.rank}: {name}: {exc}", file=sys.stderr, flush=True)
        emit(record)
        par = None
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
    if out is not None:
        out.close()


def _summarise(ops: list[dict]) -> dict:
    """{op: [count, total bytes]} of one step's collectives."""
    summary: dict = {}
    for o in ops:
        c = summary.setdefault(o["op"], [0, 0])
        c[0] += 1
        c[1] += o["nbytes"]
    return summary


if __name__ == "__main__":
    measure(json.loads(sys.argv[1]))
