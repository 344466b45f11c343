"""Tensor-parallel training-step time vs torch's own tensor parallel and vs one rank, and the
bytes the tp group moves per step vs Megatron-LM's formula.

Run under mpirun (``mpirun -n 2 python -m hpctrain bench tp``); tp = the world size. The
model is the built-in gpt (``models.registry``: tied embedding and head, dropout 0) on
random tokens; every model takes the same SGD steps on the same batch. Per configuration
(sequence parallel off and/or on):

- ours: what ``train`` runs, ``parallel.orchestrator.parallelize`` with the plan
  ``build_plan("tensor", "tp=N")`` (the gpt's own tp_plan split by parallel.tensor, then the
  dp flavour, which sums the gradients sequence parallel left partial); a step is the
  Parallelized's ``forward_backward`` and ``step``;
- torch: ``parallelize_module`` over a gloo DeviceMesh of the same ranks (torch's Llama
  recipe: Colwise qkv, mlp.0 / Rowwise proj, mlp.2 / PrepareModuleInput attn, mlp / a
  vocab-parallel embedding, head and ``loss_parallel``; SequenceParallel LayerNorms); its
  ColwiseParallel cuts qkv's rows in contiguous blocks, so the fused rows are reordered
  first to [q_0 k_0 v_0 | q_1 k_1 v_1 ...], giving each rank whole heads of q, k and v;
- one rank: the unsplit model on rank 0 while the others sleep (``pipeline._idle_barrier``).

They take turns step by step (the order rotates each round); rank 0 prints the medians of
the slowest rank's step times and of their CPU time (process time of every thread), which
leaves out the waits for a core on a shared machine.

Bytes: what the flight recorder (runtime/flight.py) logged for the tp group: every
Communicator op with the bytes of its tensor (an all-gather: this rank's part). The first
step of ours also notes the recorder's op count at the start and end of each block's
forward and backward (module hooks), which sorts the ops into the transformer blocks', the
rest of forward/backward (embedding, head, loss) and the optimizer step's (the gradient
sync). Per rank and step, under the ring algorithm, an all-reduce of N bytes sends
2(tp-1)/tp N, an all-gather or reduce-scatter of N bytes in all (tp-1)/tp N. Megatron-LM
(Korthikanti et al. 2022, sec. 4.2.2): per block and step 4 all-reduces of b*s*h elements,
or with sequence parallel 4 all-gathers + 4 reduce-scatters: 8 (tp-1)/tp b s h itemsize.
The blocks' bytes are compared with it; the rest is printed apart.

The check line compares the computation: each model's loss (float64, from its logits)
against the unsplit model before any step and after the timed ones, and the largest
difference of this rank's vocabulary slice of the logits.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import statistics
import time
import warnings

import torch

from hpctrain.runtime.flight import RECORDER, group_key

__all__ = ["SP_CHOICES", "VOCAB", "formula_bytes", "ring_bytes", "summary", "BlockSpans",
           "interleave_qkv", "report", "run"]

SP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
VOCAB = 256  # divisible by any tp the heads allow: torch's Shard(0) then cuts it as ours does
TARGET = 1.0  # ours/torch step time, same model, batch and mesh


def ring_bytes(op: str, nbytes: int, tp: int):
    """Bytes one rank sends in a ring collective of a tensor of nbytes (all-gather: the
    gathered tensor): an integer when the tensor splits into tp equal chunks."""
    sent = (2 if op == "allreduce" else 1) * (tp - 1) * nbytes
    return sent // tp if sent % tp == 0 else sent / tp


def formula_bytes(layers: int, batch: int, seq: int, hidden: int, tp: int, sp: bool,
                  itemsize: int = 4) -> dict:
    """Megatron-LM's tensor-parallel communication of the blocks per step (see the module
    docstring): {"ops": {op: count}, "bytes": per-rank ring bytes sent}."""
    n = batch * seq * hidden * itemsize
    ops = {"allgather": 4 * layers, "reduce_scatter": 4 * layers} if sp else \
        {"allreduce": 4 * layers}
    return {"ops": ops, "bytes": sum(c * ring_bytes(op, n, tp) for op, c in ops.items())}


def summary(entries, tp: int) -> dict:
    """{"ops": {op: count}, "bytes": ring bytes sent per rank, "elements": of the floating
    point tensors} of flight-recorder entries (a non-blocking op counts as its blocking form;
    an all-gather's entry holds this rank's part: the gathered tensor is tp times it)."""
    ops, sent, elements = {}, 0, 0
    for e in entries:
        op = e.op[1:] if e.op in ("iallreduce", "iallgather", "ireduce_scatter") else e.op
        nbytes = e.nbytes * (tp if op == "allgather" else 1)
        ops[op] = ops.get(op, 0) + 1
        sent += ring_bytes(op, nbytes, tp)
        dtype = getattr(torch, e.dtype, None)
        elements += nbytes // dtype.itemsize if dtype is not None and dtype.is_floating_point else 0
    return {"ops": ops, "bytes": sent, "elements": elements}


def _recorded_since(count: int, key: str) -> list:
    """The flight entries of group ``key`` started after op number ``count``."""
    n = RECORDER.count - count
    ring = list(RECORDER.ring)
    if n > len(ring):
        raise RuntimeError(f"bench tp: a step made {n} ops, more than the flight recorder "
                           f"keeps ({len(ring)})")
    return [(count + 1 + i, e) for i, e in enumerate(ring[len(ring) - n:]) if e.group == key]


class BlockSpans:
    """The recorder's op count at the start and end of each block's forward and backward."""

    def __init__(self, blocks):
        self.spans, self._open = [], None
        self._hooks = [h for b in blocks for h in (
            b.register_forward_pre_hook(self._start), b.register_forward_hook(self._end),
            b.register_full_backward_pre_hook(self._start),
            b.register_full_backward_hook(self._end))]

    def _start(self, *_):
        self._open = RECORDER.count

    def _end(self, *_):
        self.spans.append((self._open, RECORDER.count))

    def holds(self, number: int) -> bool:
        return any(a < number <= b for a, b in self.spans)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def interleave_qkv(model, tp: int) -> None:
    """Reorder each block's fused qkv rows [q; k; v] to [q_0 k_0 v_0 | q_1 k_1 v_1 ...] so a
    contiguous row split (torch's ColwiseParallel) gives rank r whole heads of each."""
    with torch.no_grad():
        for b in model.blocks:
            for p in (b.attn.qkv.weight, b.attn.qkv.bias):
                p.copy_(p.reshape(3, tp, -1).transpose(0, 1).reshape(p.shape))


def _torch_model(model, sp: bool, lr: float):
    """(the gpt split by parallelize_module over a gloo mesh of the world, its SGD)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    n = torch.distributed.get_world_size()
    seq = Shard(1) if sp else Replicate()  # the layout of the residual stream
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                    use_local_output=False)}
    block = {"attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
             "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=seq),
             "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
             "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=seq)}
    if sp:  # the position embedding's (seq, h) output: this rank's rows
        plan.update(ln_f=SequenceParallel(), pos_emb=PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)))
        block.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    interleave_qkv(model, n)
    parallelize_module(model, init_device_mesh("cpu", (n,)), plan)
    model.head.weight = model.tok_emb.weight  # tie again: each style made its own DTensor
    return model, torch.optim.SGD(model.parameters(), lr=lr)


class _Runner:
    """One configuration (tp, sequence parallel on/off): the three models and their steps."""

    def __init__(self, world, sp, layers, d_model, heads, seq_len, batch, lr, torch_ok):
        from hpctrain.models import gpt, registry
        from hpctrain.parallel.orchestrator import parallelize
        from hpctrain.parallel.plan import build_plan
        from hpctrain.parallel.tensor import TensorOptions
        from hpctrain.train.precision import Precision

        self.world, self.sp, self.loss_fn = world, sp, gpt.lm_loss
        model = registry.build("gpt", 0, vocab=VOCAB, d_model=d_model, heads=heads,
                               layers=layers, seq_len=seq_len, n_samples=1).model
        self.single = copy.deepcopy(model)  # rank 0 times it; every rank checks against it
        self.opt_single = torch.optim.SGD(self.single.parameters(), lr=lr)
        self.torch_err, self.torch_model, self.torch_counts = "", None, {}
        if torch_ok:
            try:
                self.torch_model, self.opt_torch = _torch_model(copy.deepcopy(model), sp, lr)
            except Exception as exc:  # report why the comparison is missing; never guess
                self.torch_err = f"{type(exc).__name__}: {exc}"
        plan = build_plan("tensor", f"tp={world.size}", world.size)
        with contextlib.redirect_stdout(io.StringIO()):  # the orchestrator's log lines
            self.ours = parallelize(plan, model, lambda ps: torch.optim.SGD(ps, lr=lr), world,
                                    {"tensor": TensorOptions(sequence_parallel=sp)})
        self.blocks, self.tp = model.blocks, world.mesh(plan.layout).comm("tp")
        self.key, self.prec = group_key(self.tp), Precision("fp32", torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        self.x, self.y = (torch.randint(0, VOCAB, (batch, seq_len), generator=g)
                          for _ in range(2))
        self.ops: list = []  # per step of ours: the flight entries of the tp group
        self.counted: list = []  # one step's: (kind, entry)

    def step_ours(self, count: bool = False) -> None:
        """forward_backward and step, keeping the tp ops recorded; ``count``: also sorted
        into the blocks', the rest of forward/backward's and the optimizer step's."""
        spans = BlockSpans(self.blocks) if count else None
        c0 = RECORDER.count
        self.ours.forward_backward([(self.x, self.y, 1.0)], self.loss_fn, self.prec)
        c1 = RECORDER.count
        self.ours.step()
        if spans is not None:
            spans.remove()
        ops = _recorded_since(c0, self.key)
        self.ops.append([e for _, e in ops])
        if spans is not None:
            self.counted = [("sync" if i > c1 else "blocks" if spans.holds(i) else "rest", e)
                            for i, e in ops]

    def step_torch(self, count: bool = False) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        if count:
            from torch.distributed.tensor.debug import CommDebugMode

            with CommDebugMode() as mode, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its module hooks warn about the inputs
                self.step_torch()
            self.torch_counts = {str(k).split(".")[-1]: v
                                 for k, v in mode.get_comm_counts().items()}
            return
        with loss_parallel():  # cross-entropy on the vocabulary-sharded logits
            self.loss_fn(self.torch_model(self.x), self.y).backward()
        self.opt_torch.step()
        self.opt_torch.zero_grad()

    def step_single(self) -> None:
        self.loss_fn(self.single(self.x), self.y).backward()
        self.opt_single.step()
        self.opt_single.zero_grad()

    @torch.no_grad()
    def losses(self) -> dict:
        """Each model's loss (float64, from its whole logits) and the largest difference of
        this rank's vocabulary slice of the logits from the unsplit model's (every rank's
        largest). Untimed."""
        whole = self.single(self.x)
        tp, width = self.tp, VOCAB // self.tp.size
        mine = whole[..., tp.rank * width:(tp.rank + 1) * width]
        out = {"single": float(self.loss_fn(whole.double(), self.y))}
        runs = [("ours", lambda: self.ours.model(self.x))]
        if self.torch_model is not None:
            runs.append(("torch", lambda: self.torch_model(self.x).to_local()))
        for name, forward in runs:
            local = forward()
            joined = torch.cat(list(tp.allgather(local.unsqueeze(0).contiguous())), dim=-1)
            out[name] = float(self.loss_fn(joined.double(), self.y))
            diff = (local - mine).abs().max().reshape(1)
            out[name + "_out"] = float(tp.allreduce(diff, op="max"))
        return out


def _time_rounds(world, run: _Runner, rounds: int, warmup: int) -> dict:
    """Median step seconds (slowest rank) of ours, torch and one rank, taking turns; and
    the CPU seconds of each step (process time, every thread; the largest over ranks)."""
    from hpctrain.bench.pipeline import _idle_barrier
    from hpctrain.runtime.comm.idle import set_timer_slack

    set_timer_slack()
    names = ["ours"] + (["torch"] if run.torch_model is not None else []) + ["single"]
    times = {n: [] for n in names}
    cpus = {n: [] for n in names}
    for k in range(warmup + rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            if name == "single":
                _idle_barrier(world)
                if world.rank == 0:
                    t0, c0 = time.perf_counter(), time.process_time()
                    run.step_single()
                    took = (time.perf_counter() - t0, time.process_time() - c0)
                _idle_barrier(world)
                dt, cpu = world.mpi_comm.bcast(took if world.rank == 0 else None)
            else:
                world.mpi_comm.Barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                if name == "ours":  # ops sorted and counted in an untimed step if any
                    run.step_ours(count=k == (warmup - 1 if warmup > 1 else warmup + rounds - 1))
                else:  # torch's collectives are counted in the first warm-up step
                    run.step_torch(count=k == 0 and warmup > 0)
                dt, cpu = world.host.allreduce_scalars(
                    [time.perf_counter() - t0, time.process_time() - c0], op="max")
            if k >= warmup:
                times[name].append(dt)
                cpus[name].append(cpu)
    # the first step also checks, once, that copies got equal gradients (sharding/agreement.py)
    sent = [[(e.op, e.nbytes) for e in step] for step in run.ops[1:]]
    if any(s != sent[0] for s in sent):
        raise RuntimeError("bench tp: our steps did not all move the same collectives")
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "cpu_s": {n: statistics.median(t) for n, t in cpus.items()}, "step_s": times}


def _config(world, sp, layers, d_model, heads, seq_len, batch, steps, warmup, lr,
            torch_ok, torch_err) -> dict:
    run = _Runner(world, sp, layers, d_model, heads, seq_len, batch, lr, torch_ok)
    before = run.losses()
    timed = _time_rounds(world, run, steps, warmup)
    after = run.losses()  # the one-rank model stepped on rank 0 only: its loss from there
    after["single"] = world.mpi_comm.bcast(after["single"] if world.rank == 0 else None)
    tp = world.size
    fml = formula_bytes(layers, batch, seq_len, d_model, tp, sp)
    part = {kind: summary([e for k, e in run.counted if k == kind], tp)
            for kind in ("blocks", "rest", "sync")}
    return {"tp": tp, "sp": sp, **timed,
            "measured_bytes": part["blocks"]["bytes"], "formula_bytes": fml["bytes"],
            "measured_ops": part["blocks"]["ops"], "formula_ops": fml["ops"],
            "rest_bytes": part["rest"]["bytes"], "rest_ops": part["rest"]["ops"],
            "sync_bytes": part["sync"]["bytes"], "sync_ops": part["sync"]["ops"],
            "sync_elements": part["sync"]["elements"],
            "torch_ops": run.torch_counts, "torch_error": run.torch_err or torch_err,
            "check_before": before, "check_after": after, "sgd_steps": warmup + steps}


# -- the report --------------------------------------------------------------------------

def _ops(ops: dict) -> str:
    return ", ".join(f"{c} {op}" for op, c in sorted(ops.items())) or "none"


def _row_line(r: dict) -> str:
    m = r["median_s"]
    if "torch" in m:
        ratio = m["ours"] / m["torch"]
        torch_ms, ratio_s = f"{m['torch'] * 1e3:9.1f}", f"{ratio:10.2f}"
        verdict = f"{'PASS' if round(ratio, 2) <= TARGET else 'MISS'} (<= {TARGET:.2f})"
    else:
        torch_ms, ratio_s, verdict = f"{'-':>9}", f"{'-':>10}", "no torch run"
    return (f"  {r['tp']:>3} {'on' if r['sp'] else 'off':>3} {m['ours'] * 1e3:9.1f} {torch_ms} "
            f"{m['single'] * 1e3:10.1f} {ratio_s} {verdict:>15} {m['ours'] / m['single']:11.2f} "
            f"{r['measured_bytes']:15.0f} {r['formula_bytes']:14.0f} "
            f"{r['measured_bytes'] / r['formula_bytes']:12.3f}")


def _details(r: dict) -> list:
    sp = "on" if r["sp"] else "off"
    b, a = r["check_before"], r["check_after"]

    def deltas(d):
        return ", ".join(f"{n} {abs(d[n] - d['single']):.1e}" for n in ("ours", "torch") if n in d)
    outs = ", ".join(f"{n} {b[n + '_out']:.1e}" for n in ("ours", "torch") if n in b)
    lines = [f"  sp {sp}: collectives per step, ours' blocks {_ops(r['measured_ops'])} (formula "
             f"{_ops(r['formula_ops'])}); ours outside the blocks (embedding, head, loss) "
             f"{_ops(r['rest_ops'])}, {r['rest_bytes']} bytes/rank"
             + (f"; torch's whole step {_ops(r['torch_ops'])}" if r["torch_ops"] else "")]
    if r["sync_ops"]:
        lines.append(f"  sp {sp}: + the optimizer step's gradient sync ({r['sync_elements']} "
                     f"elements, {_ops(r['sync_ops'])}): {r['sync_bytes']} bytes/rank, not in "
                     f"the formula")
    lines.append(f"  sp {sp}: check vs one rank: loss {b['single']:.6f} at step 0, |diff| "
                 f"{deltas(b)}; max |logits diff| {outs}; after {r['sgd_steps']} SGD steps "
                 f"loss {a['single']:.6f}, |diff| {deltas(a)}")
    if r["torch_error"]:
        lines.append(f"  sp {sp}: torch TP did not run: {r['torch_error']}")
    cpu, steps = r["cpu_s"], r["step_s"]
    named = [(k, n) for k, n in (("ours", "ours"), ("torch", "torch"), ("single", "one rank"))
             if k in cpu]
    lines.append(f"  sp {sp}: cpu ms/step (process time of every thread, median, largest rank; "
                 f"one rank: rank 0): " + ", ".join(f"{n} {cpu[k] * 1e3:.1f}" for k, n in named))
    lines.append(f"  sp {sp}: every timed step, ms: " + "; ".join(
        f"{n} " + " ".join(f"{t * 1e3:.0f}" for t in steps[k]) for k, n in named))
    return lines


def report(rows: list, header: dict) -> list:
    """The lines rank 0 prints."""
    h = header
    lines = [f"tp bench: {h['layers']} x GPTBlock(d_model {h['d_model']}, {h['heads']} heads, "
             f"mlp 4x) in the built-in gpt (vocab {VOCAB}, tied embedding and head), batch "
             f"{h['batch']} x seq {h['seq_len']}, fp32, a training step (forward, backward, "
             f"gradient sync, SGD step), median of {h['steps']} steps after {h['warmup']} "
             f"warm-up, {h['ranks']} ranks = tp, load average {h['load0']:.2f} -> "
             f"{h['load1']:.2f}",
             "  ours: parallelize(build_plan('tensor', 'tp=N')) over MPI; torch: "
             "parallelize_module (Colwise qkv, mlp.0, head / Rowwise proj, mlp.2, embedding / "
             "SequenceParallel LayerNorms, loss_parallel) over gloo; one rank: the unsplit "
             "model alone (the others asleep)"]
    if h.get("cores") and h["load0"] >= h["cores"] / 2:
        lines.append(f"  warning: the machine was busy before the run (load average "
                     f"{h['load0']:.2f} on {h['cores']} cores): the step times include waiting "
                     f"for a core, more so for ranks that never sleep (MPI polls) and are bound "
                     f"to one core (mpirun binds 2 ranks by default; --bind-to none lets them "
                     f"move); the cpu ms line shows the work done")
    if h.get("shared"):
        lines.append(f"  warning: {h['shared']}; ours' and torch's steps are slowed alike, "
                     f"and 'vs one rank' (which runs alone) understates the speed-up")
    lines.append("  bytes: per rank and step, ring algorithm (all-reduce 2(tp-1)/tp N, "
                 "all-gather/reduce-scatter (tp-1)/tp N), the flight recorder's tp ops inside "
                 "the blocks; formula: Megatron 8(tp-1)/tp b*s*h*4 per block")
    lines.append(f"  {'tp':>3} {'sp':>3} {'ours ms':>9} {'torch ms':>9} {'1-rank ms':>10} "
                 f"{'ours/torch':>10} {'verdict':>15} {'ours/1-rank':>11} "
                 f"{'bytes measured':>15} {'bytes formula':>14} {'meas/formula':>12}")
    lines += [_row_line(r) for r in rows]
    return lines + [line for r in rows for line in _details(r)]


def run(layers: int = 4, d_model: int = 512, heads: int = 8, seq_len: int = 256,
        batch: int = 4, steps: int = 5, warmup: int = 2, sequence_parallel: str = "both",
        torch_compare: bool = True, lr: float = 0.05, json_path: str = "") -> int:
    """Time each configuration; rank 0 prints the table (and writes json_path if given)."""
    from hpctrain.bench.pipeline import _shared_cores
    from hpctrain.runtime.world import init_world

    if sequence_parallel not in SP_CHOICES:
        raise SystemExit(f"bench tp: --sequence-parallel {sequence_parallel} is not one of "
                         f"{', '.join(SP_CHOICES)}")
    if d_model % heads:
        raise SystemExit(f"bench tp: --d-model {d_model} is not divisible by --heads {heads}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    world = init_world(device="cpu")
    n = world.size
    if n < 2:
        raise SystemExit("bench tp: run it under mpirun with tp ranks, e.g. mpirun -n 2")
    if heads % n or seq_len % n or VOCAB % n:
        raise SystemExit(f"bench tp: at tp={n} the heads ({heads}), the sequence length "
                         f"({seq_len}) and the vocabulary ({VOCAB}) must be divisible by {n}")
    if not RECORDER.enabled:
        raise SystemExit("bench tp: the flight recorder is off; its records are the bytes")
    load0, shared = os.getloadavg()[0], _shared_cores(world)
    torch_err = ""
    if torch_compare:
        try:
            from hpctrain.bench.workload import _init_gloo

            _init_gloo(world)
        except Exception as exc:
            torch_err = f"{type(exc).__name__}: {exc}"
    rows = [_config(world, sp, layers, d_model, heads, seq_len, batch, steps, warmup, lr,
                    torch_compare and not torch_err, torch_err) for sp in SP_CHOICES[sequence_parallel]]
    if world.rank == 0:
        header = {"layers": layers, "d_model": d_model, "heads": heads, "seq_len": seq_len,
                  "batch": batch, "vocab": VOCAB, "steps": steps, "warmup": warmup,
                  "ranks": n, "load0": load0, "load1": os.getloadavg()[0], "shared": shared,
                  "cores": os.cpu_count()}
        print("\n".join(report(rows, header)), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"bench": "tp", **header, "target": TARGET, "rows": rows}, f,
                          indent=1)
                f.write("\n")
            print(f"  wrote {json_path}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    world.mpi_comm.Barrier()
    return 0
