"""Tensor-parallel training-step time vs torch's tensor parallel and vs one rank, and the
bytes the tp group moves per step vs Megatron-LM's formula.

Run under mpirun (``mpirun -n 2 python -m hpctrain bench tp``); tp = the world size. Three
copies of the built-in gpt take the same SGD steps on the same random tokens, in turns (the
order rotates, so drift in the machine's load hits all alike): ours, what ``train`` runs
(``apply_plan`` with ``build_plan("tensor", "tp=N")``: the gpt's tp_plan, then the dp
flavour summing what sequence parallel left partial); torch's ``parallelize_module`` over
gloo (its Llama recipe with ``loss_parallel``; qkv's fused rows reordered first, as its
contiguous row split would not give each rank whole heads); the unsplit model on rank 0
while the others sleep. Rank 0 prints the medians of the slowest rank's step and CPU times.

Bytes: the flight recorder's entries (runtime/flight.py) of the tp group, each op with its
tensor's bytes. In one step (untimed given 2 warm-up steps) hooks note the recorder's count
around each block's forward and backward, sorting the ops into the blocks', the rest of
forward/backward's (embedding, head, loss) and the optimizer step's (gradient sync). A ring
all-reduce of N bytes sends 2(tp-1)/tp N per rank, an all-gather or reduce-scatter of N in
all (tp-1)/tp N. Megatron-LM (Korthikanti et al. 2022, 4.2.2) per block and step: 4
all-reduces of b*s*h elements, or under sequence parallel 4 all-gathers + 4 reduce-scatters.
The check line: each model's loss (float64, from its logits) vs the unsplit model's before
and after the steps, and the largest logits difference.
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

from hpctrain.bench.cores import idle_barrier, shared_cores
from hpctrain.bench.gloo_group import destroy_gloo, init_gloo
from hpctrain.runtime.comm.base import BLOCKING_FORM
from hpctrain.runtime.flight import RECORDER, group_key

__all__ = ["SP_CHOICES", "VOCAB", "formula_bytes", "ring_bytes", "summary", "interleave_qkv",
           "report", "run"]

SP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}
VOCAB = 256  # divisible by any tp the heads allow: torch's Shard(0) then cuts as ours does
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
    point tensors} of flight entries (an all-gather's entry holds this rank's part)."""
    ops, sent, elements = {}, 0, 0
    for e in entries:
        op = BLOCKING_FORM.get(e.op, e.op)
        nbytes = e.nbytes * (tp if op == "allgather" else 1)
        ops[op] = ops.get(op, 0) + 1
        sent += ring_bytes(op, nbytes, tp)
        dtype = getattr(torch, e.dtype, None)
        elements += nbytes // dtype.itemsize if getattr(dtype, "is_floating_point", 0) else 0
    return {"ops": ops, "bytes": sent, "elements": elements}


def _recorded_since(count: int, key: str) -> list:
    """(op number, entry) of the flight entries of group ``key`` after op number ``count``."""
    n, ring = RECORDER.count - count, list(RECORDER.ring)
    if n > len(ring):
        raise RuntimeError(f"bench tp: a step made {n} ops, more than the flight recorder "
                           f"keeps ({len(ring)})")
    return [(count + 1 + i, e) for i, e in enumerate(ring[len(ring) - n:]) if e.group == key]


def _block_spans(blocks) -> tuple[list, list]:
    """(spans, hook handles): each block's forward and backward appends (op count at its
    start, at its end) to spans."""
    spans, start = [], [0]

    def begin(*_):
        start[0] = RECORDER.count

    def end(*_):
        spans.append((start[0], RECORDER.count))
    return spans, [h for b in blocks for h in (
        b.register_forward_pre_hook(begin), b.register_forward_hook(end),
        b.register_full_backward_pre_hook(begin), b.register_full_backward_hook(end))]


def interleave_qkv(model, tp: int) -> None:
    """Reorder each block's fused qkv rows [q; k; v] to [q_0 k_0 v_0 | q_1 k_1 v_1 ...] so a
    contiguous row split (torch's ColwiseParallel) gives rank r whole heads of each."""
    with torch.no_grad():
        for b in model.blocks:
            for p in (b.attn.qkv.weight, b.attn.qkv.bias):
                p.copy_(p.reshape(3, tp, -1).transpose(0, 1).reshape(p.shape))


def _torch_model(model, sp: bool):
    """The gpt split by torch's parallelize_module over a gloo mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    n, seq = torch.distributed.get_world_size(), Shard(1) if sp else Replicate()
    whole = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    block = {"attn": whole, "attn.qkv": ColwiseParallel(), "mlp": whole,
             "attn.proj": RowwiseParallel(output_layouts=seq), "mlp.0": ColwiseParallel(),
             "mlp.2": RowwiseParallel(output_layouts=seq)}
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                    use_local_output=False)}
    if sp:  # the position embedding's (seq, h) output: this rank's rows
        block.update(ln1=SequenceParallel(), ln2=SequenceParallel())
        plan.update(ln_f=SequenceParallel(), pos_emb=PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    interleave_qkv(model, n)
    parallelize_module(model, init_device_mesh("cpu", (n,)), plan)
    model.head.weight = model.tok_emb.weight  # tie again: each style made its own DTensor
    return model


class _Runner:
    """One configuration (tp, sequence parallel on/off): the three models and their steps."""

    def __init__(self, world, sp, dims: dict, lr, torch_ok):
        from hpctrain.models import gpt, registry
        from hpctrain.parallel.orchestrator import apply_plan
        from hpctrain.parallel.plan import build_plan
        from hpctrain.parallel.tensor import TensorOptions
        from hpctrain.train.precision import Precision

        model = registry.build("gpt", 0, vocab=VOCAB, n_samples=1, **{
            k: dims[k] for k in ("layers", "d_model", "heads", "seq_len")}).model
        self.loss_fn, self.blocks, self.torch_err = gpt.lm_loss, model.blocks, ""
        self.single, self.torch_model = copy.deepcopy(model), None  # one rank, on rank 0
        if torch_ok:
            try:
                self.torch_model = _torch_model(copy.deepcopy(model), sp)
            except Exception as exc:  # report why the comparison is missing; never guess
                self.torch_err = f"{type(exc).__name__}: {exc}"
        self.opts = {n: torch.optim.SGD(m.parameters(), lr=lr) for n, m in
                     (("single", self.single), ("torch", self.torch_model)) if m is not None}
        plan = build_plan("tensor", f"tp={world.size}", world.size)
        with contextlib.redirect_stdout(io.StringIO()):  # the orchestrator's log lines
            self.ours = apply_plan(plan, model, lambda ps: torch.optim.SGD(ps, lr=lr), world,
                                    {"tensor": TensorOptions(sequence_parallel=sp)})
        self.tp = world.mesh(plan.layout).comm("tp")
        self.prec = Precision("fp32", torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        self.x, self.y = (torch.randint(0, VOCAB, (dims["batch"], dims["seq_len"]),
                                        generator=g) for _ in range(2))
        self.ops, self.counted = [], []  # each step's tp entries; one step's (part, entry)
        self.torch_counts: dict = {}

    def step_ours(self, count: bool = False) -> None:
        """forward_backward and step; ``count``: sort the tp ops into the step's parts."""
        spans, hooks = _block_spans(self.blocks) if count else (None, [])
        c0 = RECORDER.count
        self.ours.forward_backward([(self.x, self.y, 1.0)], self.loss_fn, self.prec)
        c1 = RECORDER.count
        self.ours.step()
        for h in hooks:
            h.remove()
        ops = _recorded_since(c0, group_key(self.tp))
        self.ops.append([e for _, e in ops])
        if count:
            self.counted = [("sync" if i > c1 else "blocks" if any(a < i <= b for a, b in spans)
                             else "rest", e) for i, e in ops]

    def step_torch(self, count: bool = False) -> None:
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.distributed.tensor.parallel import loss_parallel

        with CommDebugMode() if count else contextlib.nullcontext() as mode, \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CommDebugMode's module hooks warn
            with loss_parallel():  # cross-entropy on the vocabulary-sharded logits
                self.loss_fn(self.torch_model(self.x), self.y).backward()
            self.opts["torch"].step()
            self.opts["torch"].zero_grad()
        if count:
            self.torch_counts = {str(k).split(".")[-1]: v
                                 for k, v in mode.get_comm_counts().items()}

    def step_single(self) -> None:
        self.loss_fn(self.single(self.x), self.y).backward()
        self.opts["single"].step()
        self.opts["single"].zero_grad()

    @torch.no_grad()
    def losses(self) -> dict:
        """Each model's loss (float64, from its whole logits) and the largest difference of
        this rank's vocabulary slice of the logits from the unsplit model's. Untimed."""
        whole, tp = self.single(self.x), self.tp
        mine = whole.chunk(tp.size, dim=-1)[tp.rank]
        out = {"single": float(self.loss_fn(whole.double(), self.y))}
        runs = {"ours": lambda: self.ours.model(self.x)}
        if self.torch_model is not None:
            runs["torch"] = lambda: self.torch_model(self.x).to_local()
        for name, forward in runs.items():
            local = forward()
            joined = torch.cat(list(tp.allgather(local.unsqueeze(0).contiguous())), dim=-1)
            out[name] = float(self.loss_fn(joined.double(), self.y))
            diff = (local - mine).abs().max().reshape(1)
            out[name + "_out"] = float(tp.allreduce(diff, op="max"))
        return out


def _time_rounds(world, run: _Runner, rounds: int, warmup: int) -> dict:
    """Median step seconds (slowest rank) of ours, torch and one rank, taking turns; and
    the CPU seconds of each step (process time, every thread; the largest over ranks)."""
    from hpctrain.runtime.comm.idle import set_timer_slack

    set_timer_slack()
    names = ["ours"] + (["torch"] if run.torch_model is not None else []) + ["single"]
    times, cpus = {n: [] for n in names}, {n: [] for n in names}
    counted = warmup - 1 if warmup > 1 else warmup + rounds - 1  # not the first step
    for k in range(warmup + rounds):
        for name in names[k % len(names):] + names[:k % len(names)]:
            alone = name == "single"  # rank 0 alone, the others asleep (no MPI polling)
            (idle_barrier if alone else lambda w: w.mpi_comm.Barrier())(world)
            t0, c0 = time.perf_counter(), time.process_time()
            if name == "ours":
                run.step_ours(count=k == counted)
            elif name == "torch":  # its collectives counted in the first warm-up step
                run.step_torch(count=k == 0 and warmup > 0)
            elif world.rank == 0:
                run.step_single()
            took = [time.perf_counter() - t0, time.process_time() - c0]
            if alone:
                idle_barrier(world)
                dt, cpu = world.mpi_comm.bcast(took)
            else:
                dt, cpu = world.host.allreduce_scalars(took, op="max")
            if k >= warmup:
                times[name].append(dt)
                cpus[name].append(cpu)
    # the first step also checks, once, that copies got equal gradients (sharding/agreement.py)
    sent = [[(e.op, e.nbytes) for e in step] for step in run.ops[1:]]
    if any(s != sent[0] for s in sent):
        raise RuntimeError("bench tp: our steps did not all move the same collectives")
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "cpu_s": {n: statistics.median(t) for n, t in cpus.items()}, "step_s": times}


def _config(world, sp, dims, steps, warmup, lr, torch_ok, torch_err) -> dict:
    run = _Runner(world, sp, dims, lr, torch_ok)
    before = run.losses()
    timed = _time_rounds(world, run, steps, warmup)
    after = run.losses()  # the one-rank model stepped on rank 0 only: its loss from there
    after["single"] = world.mpi_comm.bcast(after["single"])
    fml = formula_bytes(dims["layers"], dims["batch"], dims["seq_len"], dims["d_model"],
                        world.size, sp)
    part = {p: summary([e for q, e in run.counted if q == p], world.size)
            for p in ("blocks", "rest", "sync")}
    return {"tp": world.size, "sp": sp, **timed, "formula_bytes": fml["bytes"],
            "measured_bytes": part["blocks"]["bytes"], "measured_ops": part["blocks"]["ops"],
            "formula_ops": fml["ops"], **{f"{p}_{k}": part[p][k] for p in ("rest", "sync")
                                          for k in ("bytes", "ops")},
            "sync_elements": part["sync"]["elements"], "torch_ops": run.torch_counts,
            "torch_error": run.torch_err or torch_err, "check_before": before,
            "check_after": after, "sgd_steps": warmup + steps}


def _ops(ops: dict) -> str:
    return ", ".join(f"{c} {op}" for op, c in sorted(ops.items())) or "none"


def _lines(r: dict) -> tuple[str, list]:
    """The table row of a configuration, and the lines about it."""
    m, sp, b, a = r["median_s"], "on" if r["sp"] else "off", r["check_before"], r["check_after"]
    torch_ms, ratio_s, verdict = f"{'-':>9}", f"{'-':>10}", "no torch run"
    if "torch" in m:
        ratio = m["ours"] / m["torch"]
        torch_ms, ratio_s = f"{m['torch'] * 1e3:9.1f}", f"{ratio:10.2f}"
        verdict = f"{'PASS' if round(ratio, 2) <= TARGET else 'MISS'} (<= {TARGET:.2f})"
    row = (f"  {r['tp']:>3} {sp:>3} {m['ours'] * 1e3:9.1f} {torch_ms} {m['single'] * 1e3:10.1f} "
           f"{ratio_s} {verdict:>15} {m['ours'] / m['single']:11.2f} {r['measured_bytes']:15.0f} "
           f"{r['formula_bytes']:14.0f} {r['measured_bytes'] / r['formula_bytes']:12.3f}")

    def deltas(d):
        return ", ".join(f"{n} {abs(d[n] - d['single']):.1e}" for n in ("ours", "torch") if n in d)
    outs = ", ".join(f"{n} {b[n + '_out']:.1e}" for n in ("ours", "torch") if n in b)
    named = [(k, n) for k, n in (("ours", "ours"), ("torch", "torch"), ("single", "one rank"))
             if k in m]
    lines = [f"collectives per step, ours' blocks {_ops(r['measured_ops'])} (formula "
             f"{_ops(r['formula_ops'])}), ours outside them (embedding, head, loss) "
             f"{_ops(r['rest_ops'])}: {r['rest_bytes']} bytes/rank"
             + (f"; torch's whole step {_ops(r['torch_ops'])}" if r["torch_ops"] else ""),
             f"+ the optimizer step's gradient sync ({r['sync_elements']} elements, "
             f"{_ops(r['sync_ops'])}): {r['sync_bytes']} bytes/rank" if r["sync_ops"] else "",
             f"check vs one rank: loss {b['single']:.6f} at step 0, |diff| {deltas(b)}; max "
             f"|logits diff| {outs}; after {r['sgd_steps']} SGD steps loss {a['single']:.6f}, "
             f"|diff| {deltas(a)}",
             f"torch TP did not run: {r['torch_error']}" if r["torch_error"] else "",
             "cpu ms/step (process time of every thread, median, largest rank; one rank: rank "
             "0): " + ", ".join(f"{n} {r['cpu_s'][k] * 1e3:.1f}" for k, n in named),
             "every timed step, ms: " + "; ".join(
                 f"{n} " + " ".join(f"{t * 1e3:.0f}" for t in r["step_s"][k]) for k, n in named)]
    return row, [f"  sp {sp}: {line}" for line in lines if line]


def report(rows: list, h: dict) -> list:
    """The lines rank 0 prints (h: the header's figures)."""
    lines = [f"tp bench: {h['layers']} x GPTBlock(d_model {h['d_model']}, {h['heads']} heads, "
             f"mlp 4x) in the built-in gpt (vocab {VOCAB}, tied embedding and head), batch "
             f"{h['batch']} x seq {h['seq_len']}, fp32, a training step (forward, backward, "
             f"gradient sync, SGD), median of {h['steps']} steps after {h['warmup']} warm-up, "
             f"{h['ranks']} ranks = tp, load average {h['load0']:.2f} -> {h['load1']:.2f}",
             "  ours: apply_plan(build_plan('tensor', 'tp=N')) over MPI; torch: "
             "parallelize_module (Colwise qkv, mlp.0, head / Rowwise proj, mlp.2, embedding / "
             "SequenceParallel LayerNorms / loss_parallel) over gloo; one rank: the unsplit "
             "model alone (the others asleep)"]
    if h.get("cores") and h["load0"] >= h["cores"] / 2:
        lines.append(f"  warning: the machine was busy (load average {h['load0']:.2f} on "
                     f"{h['cores']} cores): step times include waits for a core, more so for "
                     f"ranks that poll (MPI) bound to one core (mpirun --bind-to none lets them "
                     f"move); the cpu ms line shows the work done")
    if h.get("shared"):
        lines.append(f"  warning: {h['shared']}; ours' and torch's steps are slowed alike, "
                     f"and 'vs one rank' (which runs alone) understates the speed-up")
    lines += ["  bytes: per rank and step, ring algorithm (all-reduce 2(tp-1)/tp N, all-gather/"
              "reduce-scatter (tp-1)/tp N), the flight recorder's tp ops in the blocks; "
              "formula: Megatron 8(tp-1)/tp b*s*h*4 per block",
              f"  {'tp':>3} {'sp':>3} {'ours ms':>9} {'torch ms':>9} {'1-rank ms':>10} "
              f"{'ours/torch':>10} {'verdict':>15} {'ours/1-rank':>11} {'bytes measured':>15} "
              f"{'bytes formula':>14} {'meas/formula':>12}"]
    done = [_lines(r) for r in rows]
    return lines + [row for row, _ in done] + [line for _, more in done for line in more]


def run(layers: int = 4, d_model: int = 512, heads: int = 8, seq_len: int = 256,
        batch: int = 4, steps: int = 5, warmup: int = 2, sequence_parallel: str = "both",
        torch_compare: bool = True, lr: float = 0.05, json_path: str = "") -> int:
    """Time each configuration; rank 0 prints the table (and writes json_path if given)."""
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
        raise SystemExit("bench tp: the flight recorder is off, and its entries are the bytes")
    load0, shared, torch_err = os.getloadavg()[0], shared_cores(world), ""
    if torch_compare:
        try:
            init_gloo(world)
        except Exception as exc:
            torch_err = f"{type(exc).__name__}: {exc}"
    dims = dict(layers=layers, d_model=d_model, heads=heads, seq_len=seq_len, batch=batch)
    rows = [_config(world, sp, dims, steps, warmup, lr, torch_compare and not torch_err,
                    torch_err) for sp in SP_CHOICES[sequence_parallel]]
    if world.rank == 0:
        header = {**dims, "vocab": VOCAB, "steps": steps, "warmup": warmup, "ranks": n,
                  "load0": load0, "load1": os.getloadavg()[0], "shared": shared,
                  "cores": os.cpu_count()}
        print("\n".join(report(rows, header)), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"bench": "tp", **header, "target": TARGET, "rows": rows}, f,
                          indent=1)
                f.write("\n")
            print(f"  wrote {json_path}")
    if torch.distributed.is_initialized():
        destroy_gloo(world)
    world.mpi_comm.Barrier()
    return 0
