"""Tensor-parallel step time vs torch's own tensor parallel and vs one rank, and the bytes the
tp group moves per step vs Megatron-LM's formula.

Run under mpirun (``mpirun -n 2 python -m hpctrain bench tp``); tp = the world size. The
model is a stack of the GPT's blocks (``models.gpt.GPTBlock``, dropout 0) on random
(batch, seq, d_model) activations, loss = mean of the output squared; a step is forward,
backward and an SGD step (plus, for ours under sequence parallel, the all-reduce of the
partial gradients of the parameters that ran on sequence chunks, which torch does inside
its optimizer step). Per configuration (sequence parallel off and/or on):

- ours: ``hpctrain.parallel.tensor.prepare`` with the stack's ``tp_plan`` (Megatron's
  column/row-parallel layers over our Communicator); under sequence parallel the stack's
  input is this rank's sequence chunk (``ops.seq_chunk``) and so is its output;
- torch: ``torch.distributed.tensor.parallel.parallelize_module`` over a gloo DeviceMesh of
  the same ranks, the same weights, the same batch. torch's ColwiseParallel cuts a fused
  qkv weight [q; k; v] by rows, which would give rank 0 all of q and part of k rather than
  whole heads of each, so the torch stack is an equivalent block class with separate q, k,
  v Linear layers (rows copied from the fused weight), each ColwiseParallel; the attention
  and MLP take their input through ``PrepareModuleInput`` (one DTensor, so the three q/k/v
  input gradients are summed before one reduction, as Megatron's one all-reduce); with
  sequence parallel the LayerNorms are ``SequenceParallel`` and the row-parallel outputs
  ``Shard(1)`` (torch's Llama recipe);
- one rank: the unsplit stack on rank 0 while the other ranks sleep in a barrier that does
  not spin (``pipeline._idle_barrier``), so it runs alone on the machine.

The three take turns step by step (the order rotates each round), so drift in the
machine's load hits all alike; rank 0 prints the medians of the slowest rank's step times,
and the CPU time of the steps (process time, every thread: gloo's included): on a machine
shared with other jobs a step's wall time also holds the time its ranks waited for a core,
which the CPU time leaves out.

Bytes: a recording wrapper around the tp Communicator logs every collective of our layers
(op, bytes of the tensor). Per rank and step, under the ring algorithm, an all-reduce of N
bytes sends 2(tp-1)/tp N, an all-gather or reduce-scatter of N bytes in all (the gathered
tensor; the reduced one) (tp-1)/tp N. Megatron-LM (Korthikanti et al. 2022, sec. 4.2.2):
per transformer block and step, without sequence parallel 4 all-reduces (2 forward, 2
backward) of b*s*h elements; with it 4 all-gathers + 4 reduce-scatters of b*s*h in all
(each rank contributing b*s*h/tp): the same bytes, 8 (tp-1)/tp b s h itemsize per block.
The gradient all-reduce of the sequence-parallel parameters (2 LayerNorms and 2 row-parallel
biases, 6h elements per block) is not in the formula and is printed apart.

The check line compares the computation, not the speed: the loss of ours and torch's
against the unsplit stack on the same batch before any step, the largest difference of the
output (rank 0's part), and the loss again after the timed steps (every model took the
same number of SGD steps).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BlockStack", "TorchBlock", "TorchStack", "CountingComm", "MeshWithTP", "formula_bytes",
           "ring_bytes", "torch_plan", "run", "SP_CHOICES"]

SP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


# -- the models --------------------------------------------------------------------------

class BlockStack(nn.Module):
    """``layers`` GPTBlocks (dropout 0) with the GPT's tensor-parallel plan for them."""

    def __init__(self, layers: int, d_model: int, heads: int):
        super().__init__()
        from hpctrain.models.gpt import GPTBlock

        self.blocks = nn.ModuleList(GPTBlock(d_model, heads, dropout=0.0) for _ in range(layers))
        seq = "sequence_parallel"
        self.tp_plan = {"blocks.*.ln1": seq, "blocks.*.ln2": seq,
                        "blocks.*.drop1": seq, "blocks.*.drop2": seq,
                        "blocks.*.attn.qkv": {"style": "colwise", "parts": 3, "heads": heads},
                        "blocks.*.attn.proj": "rowwise",
                        "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _TorchAttention(nn.Module):
    """CausalSelfAttention with q, k, v as three Linear layers (torch's ColwiseParallel then
    gives each rank whole heads of each); the heads it runs are read from q's width."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.head_dim = d_model // heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t = x.shape[0], x.shape[1]
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class TorchBlock(nn.Module):
    """GPTBlock (dropout 0) with separate q, k, v; ``from_gpt`` copies a GPTBlock's weights."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _TorchAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    @classmethod
    def from_gpt(cls, block) -> "TorchBlock":
        d, heads = block.ln1.normalized_shape[0], block.attn.heads
        out = cls(d, heads, block.mlp[0].out_features // d)
        with torch.no_grad():
            for name in ("ln1", "ln2", "attn.proj", "mlp.0", "mlp.2"):
                out.get_submodule(name).load_state_dict(block.get_submodule(name).state_dict())
            w, b = block.attn.qkv.weight.chunk(3, 0), block.attn.qkv.bias.chunk(3, 0)
            for i, lin in enumerate((out.attn.q, out.attn.k, out.attn.v)):
                lin.weight.copy_(w[i])
                lin.bias.copy_(b[i])
        return out


class TorchStack(nn.Module):
    """TorchBlocks in a ModuleList, run in turn."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def torch_plan(sp: bool) -> dict:
    """parallelize_module's plan for one TorchBlock (Megatron's layout, torch's styles)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    seq = Shard(1) if sp else Replicate()  # the layout of the residual stream
    plan = {"attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=seq)}
    if sp:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    return plan


# -- counting the bytes ------------------------------------------------------------------

class CountingComm:
    """A Communicator that logs every collective before passing it on: ``log`` holds
    (tag, op, bytes of the tensor: the whole one for all-reduce and reduce-scatter, the
    gathered one for all-gather). Everything else goes to the wrapped communicator."""

    def __init__(self, comm):
        self._comm = comm
        self.tag = "act"
        self.log: list = []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def allreduce(self, tensor, op="sum"):
        self.log.append((self.tag, "allreduce", tensor.numel() * tensor.element_size()))
        return self._comm.allreduce(tensor, op)

    def allgather(self, tensor, out=None):
        self.log.append((self.tag, "allgather",
                         tensor.numel() * tensor.element_size() * self._comm.size))
        return self._comm.allgather(tensor, out)

    def reduce_scatter(self, tensor, out=None, op="sum"):
        self.log.append((self.tag, "reduce_scatter", tensor.numel() * tensor.element_size()))
        return self._comm.reduce_scatter(tensor, out, op)

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("CountingComm logs the blocking collectives only")

    iallreduce = iallgather = ireduce_scatter = _refuse


class MeshWithTP:
    """The mesh with its tp communicator swapped for another (a CountingComm)."""

    def __init__(self, mesh, tp):
        self._mesh, self._tp = mesh, tp
        self.coords = mesh.coords

    def comm(self, dim):
        return self._tp if dim == "tp" else self._mesh.comm(dim)

    def size(self, dim):
        return self._mesh.size(dim)


def ring_bytes(op: str, nbytes: int, tp: int):
    """Bytes one rank sends in a ring collective of a tensor of nbytes (all-gather: the
    gathered tensor): an integer when the tensor splits into tp equal chunks."""
    sent = (2 if op == "allreduce" else 1) * (tp - 1) * nbytes
    return sent // tp if sent % tp == 0 else sent / tp


def formula_bytes(layers: int, batch: int, seq: int, hidden: int, tp: int, sp: bool,
                  itemsize: int = 4) -> dict:
    """Megatron-LM's tensor-parallel communication per step (see the module docstring):
    {"ops": {op: count}, "bytes": per-rank ring bytes sent}."""
    n = batch * seq * hidden * itemsize
    ops = {"allgather": 4 * layers, "reduce_scatter": 4 * layers} if sp else \
        {"allreduce": 4 * layers}
    return {"ops": ops, "bytes": sum(c * ring_bytes(op, n, tp) for op, c in ops.items())}


def _summary(log, tag: str, tp: int) -> dict:
    ops: dict = {}
    for t, op, _ in log:
        if t == tag:
            ops[op] = ops.get(op, 0) + 1
    return {"ops": ops, "bytes": sum(ring_bytes(op, b, tp) for t, op, b in log if t == tag)}


# -- the steps ---------------------------------------------------------------------------

def _loss(out, total: int):
    """Mean of the whole output squared; ``out`` may be a sequence chunk (total: the whole
    output's elements), so every rank's loss is its part of the sum."""
    return out.square().sum() / total


def _partial_params(model) -> list:
    """Parameters whose gradients are partial sums over tp (ran on sequence chunks)."""
    from hpctrain.parallel.placement import placement_of

    return [p for p in model.parameters()
            if any(c.name == "tp" and c.partial for c in placement_of(p).copies)]


def _sync_partial(params, tp) -> None:
    """Sum the partial gradients over tp in one flat all-reduce (Megatron: the sequence-
    parallel gradients' all-reduce)."""
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    tp.allreduce(flat)
    i = 0
    for p in params:
        p.grad.copy_(flat[i:i + p.numel()].view_as(p.grad))
        i += p.numel()


def _idle_barrier(world) -> None:
    from hpctrain.bench.pipeline import _idle_barrier as idle

    idle(world)


class _Runner:
    """One configuration (tp, sequence parallel on/off): the three models and their steps."""

    def __init__(self, world, mesh, sp, layers, d_model, heads, seq_len, batch, lr,
                 torch_mesh):
        from hpctrain.parallel.tensor import TensorOptions, prepare
        from hpctrain.parallel.tensor.ops import seq_chunk

        self.world, self.sp, self.lr = world, sp, lr
        raw = mesh.comm("tp")
        self.tp = CountingComm(raw)
        torch.manual_seed(0)
        whole = BlockStack(layers, d_model, heads)
        state = copy.deepcopy(whole.state_dict())  # before any split
        self.single = whole  # rank 0 times it; every rank checks against it
        ours = BlockStack(layers, d_model, heads)
        ours.load_state_dict(state)
        self.ours, _ = prepare(ours, world, MeshWithTP(mesh, self.tp), TensorOptions(sp))
        self.partial = _partial_params(self.ours)
        self.opt_ours = torch.optim.SGD(self.ours.parameters(), lr=lr)
        self.opt_single = torch.optim.SGD(self.single.parameters(), lr=lr)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(batch, seq_len, d_model, generator=g)
        self.total = self.x.numel()
        self.x_local = seq_chunk(self.x, raw).contiguous() if sp else self.x
        self.torch_err = ""
        self.torch_model = None
        if torch_mesh is not None:
            try:
                self.torch_model = self._build_torch(torch_mesh, state, layers, d_model, heads)
                self.opt_torch = torch.optim.SGD(self.torch_model.parameters(), lr=lr)
            except Exception as exc:  # report why the comparison is missing; never guess
                self.torch_err = f"{type(exc).__name__}: {exc}"
        self.torch_counts: dict = {}

    def _build_torch(self, torch_mesh, state, layers, d_model, heads):
        from torch.distributed.tensor.parallel import parallelize_module

        ref = BlockStack(layers, d_model, heads)
        ref.load_state_dict(state)
        stack = TorchStack([TorchBlock.from_gpt(b) for b in ref.blocks])
        for b in stack.blocks:
            parallelize_module(b, torch_mesh, torch_plan(self.sp))
        return stack

    # each step: forward, backward, the optimizer step (and zero_grad)
    def step_ours(self) -> None:
        self.tp.tag = "act"
        loss = _loss(self.ours(self.x_local), self.total)
        loss.backward()
        self.tp.tag = "sync"
        _sync_partial(self.partial, self.tp)
        self.opt_ours.step()
        self.opt_ours.zero_grad()

    def step_torch(self, count: bool = False) -> None:
        if count:
            from torch.distributed.tensor.debug import CommDebugMode

            with CommDebugMode() as mode, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its module hooks warn about the inputs
                self.step_torch()
            self.torch_counts = {str(k).split(".")[-1]: v
                                 for k, v in mode.get_comm_counts().items()}
            return
        _loss(self.torch_model(self.x_local), self.total).backward()
        self.opt_torch.step()
        self.opt_torch.zero_grad()

    def step_single(self) -> None:
        _loss(self.single(self.x), self.total).backward()
        self.opt_single.step()
        self.opt_single.zero_grad()

    # the check: same computation?
    @torch.no_grad()
    def losses(self) -> dict:
        """Global loss of each model on the batch, and (rank 0's part) the largest output
        difference from the unsplit stack. Untimed; its collectives are not counted."""
        raw = self.tp._comm
        whole = self.single(self.x)
        mine = whole.narrow(1, raw.rank * whole.shape[1] // raw.size,
                            whole.shape[1] // raw.size) if self.sp else whole
        out = {"single": float(_loss(whole.double(), self.total))}
        runs = [("ours", self.ours)]
        if self.torch_model is not None:
            runs.append(("torch", self.torch_model))
        for name, fn in runs:
            y = fn(self.x_local)
            y = y.to_local() if hasattr(y, "to_local") else y
            part = _loss(y.double(), self.total).reshape(1)
            if self.sp:
                raw.allreduce(part)
            out[name] = float(part)
            diff = (y - mine).abs().max().reshape(1)
            out[name + "_out"] = float(raw.allreduce(diff, op="max"))
        return out


def _time_rounds(world, run: _Runner, rounds: int, warmup: int) -> dict:
    """Median step seconds (slowest rank) of ours, torch and one rank, taking turns; and
    the CPU seconds of each step (process time, every thread; the largest over ranks)."""
    from hpctrain.runtime.comm.idle import set_timer_slack

    set_timer_slack()
    names = ["ours"] + (["torch"] if run.torch_model is not None else []) + ["single"]
    times = {n: [] for n in names}
    cpus = {n: [] for n in names}
    logs = []
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
                if name == "ours":
                    run.tp.log = []
                t0, c0 = time.perf_counter(), time.process_time()
                if name == "ours":
                    run.step_ours()
                else:  # torch's collectives are counted in the first warm-up step
                    run.step_torch(count=k == 0 and warmup > 0)
                dt, cpu = world.host.allreduce_scalars(
                    [time.perf_counter() - t0, time.process_time() - c0], op="max")
                if name == "ours":
                    logs.append(run.tp.log)
            if k >= warmup:
                times[name].append(dt)
                cpus[name].append(cpu)
    if any(log != logs[0] for log in logs):
        raise RuntimeError("bench tp: our steps did not all move the same collectives")
    return {"median_s": {n: statistics.median(t) for n, t in times.items()},
            "cpu_s": {n: statistics.median(t) for n, t in cpus.items()},
            "step_s": times, "log": logs[0]}


def _config(world, mesh, torch_mesh, sp, layers, d_model, heads, seq_len, batch, steps,
            warmup, lr, torch_err) -> dict:
    run = _Runner(world, mesh, sp, layers, d_model, heads, seq_len, batch, lr, torch_mesh)
    run.torch_err = run.torch_err or torch_err
    before = run.losses()
    timed = _time_rounds(world, run, steps, warmup)
    # the one-rank model stepped on rank 0 only: its loss after the steps comes from there
    after = run.losses()
    after["single"] = world.mpi_comm.bcast(after["single"] if world.rank == 0 else None)
    tp = world.size
    fml = formula_bytes(layers, batch, seq_len, d_model, tp, sp)
    act = _summary(timed["log"], "act", tp)
    sync = _summary(timed["log"], "sync", tp)
    sync_elems = sum(p.numel() for p in run.partial)
    return {"tp": tp, "sp": sp, "median_s": timed["median_s"], "step_s": timed["step_s"],
            "cpu_s": timed["cpu_s"],
            "measured_bytes": act["bytes"], "formula_bytes": fml["bytes"],
            "measured_ops": act["ops"], "formula_ops": fml["ops"],
            "sync_bytes": sync["bytes"], "sync_ops": sync["ops"], "sync_elements": sync_elems,
            "torch_ops": run.torch_counts, "torch_error": run.torch_err,
            "check_before": before, "check_after": after, "sgd_steps": warmup + steps}


def _node_cores() -> set:
    """The CPUs of this machine (not this rank's binding)."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            text = f.read().strip()
        out = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


# -- the report --------------------------------------------------------------------------

TARGET = 1.0  # ours/torch TP step time, same model, batch and mesh


def _ops(ops: dict) -> str:
    return ", ".join(f"{c} {op}" for op, c in sorted(ops.items())) or "none"


def report(rows: list, header: dict) -> list:
    """The lines rank 0 prints."""
    h = header
    lines = [f"tp bench: {h['layers']} x GPTBlock(d_model {h['d_model']}, {h['heads']} heads, "
             f"mlp 4x), batch {h['batch']} x seq {h['seq_len']}, fp32, forward+backward+SGD "
             f"step, median of {h['steps']} steps after {h['warmup']} warm-up, {h['ranks']} "
             f"ranks = tp, load average {h['load0']:.2f} -> {h['load1']:.2f}",
             "  ours: hpctrain.parallel.tensor over MPI; torch: parallelize_module "
             "(PrepareModuleInput attn, mlp / Colwise q,k,v, mlp.0 / Rowwise proj, mlp.2 / "
             "SequenceParallel LayerNorms) over gloo; one rank: the unsplit stack alone (the "
             "others asleep)"]
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
                 "all-gather/reduce-scatter (tp-1)/tp N); formula: Megatron 8(tp-1)/tp "
                 "b*s*h*4 per block")
    lines.append(f"  {'tp':>3} {'sp':>3} {'ours ms':>9} {'torch ms':>9} {'1-rank ms':>10} "
                 f"{'ours/torch':>10} {'verdict':>15} {'ours/1-rank':>11} "
                 f"{'bytes measured':>15} {'bytes formula':>14} {'meas/formula':>12}")
    for r in rows:
        m = r["median_s"]
        ours, single = m["ours"] * 1e3, m["single"] * 1e3
        if "torch" in m:
            ratio = m["ours"] / m["torch"]
            torch_ms, ratio_s = f"{m['torch'] * 1e3:9.1f}", f"{ratio:10.2f}"
            verdict = f"{'PASS' if round(ratio, 2) <= TARGET else 'MISS'} (<= {TARGET:.2f})"
        else:
            torch_ms, ratio_s, verdict = f"{'-':>9}", f"{'-':>10}", "no torch run"
        lines.append(f"  {r['tp']:>3} {'on' if r['sp'] else 'off':>3} {ours:9.1f} {torch_ms} "
                     f"{single:10.1f} {ratio_s} {verdict:>15} {m['ours'] / m['single']:11.2f} "
                     f"{r['measured_bytes']:15.0f} {r['formula_bytes']:14.0f} "
                     f"{r['measured_bytes'] / r['formula_bytes']:12.3f}")
    for r in rows:
        sp = "on" if r["sp"] else "off"
        lines.append(f"  sp {sp}: collectives per step, ours {_ops(r['measured_ops'])} "
                     f"(formula {_ops(r['formula_ops'])})"
                     + (f"; torch {_ops(r['torch_ops'])}" if r["torch_ops"] else ""))
        if r["sync_ops"]:
            lines.append(f"  sp {sp}: + gradient all-reduce of the sequence-parallel parameters "
                         f"({r['sync_elements']} elements, {_ops(r['sync_ops'])}): "
                         f"{r['sync_bytes']} bytes/rank/step, not in the formula (torch "
                         f"reduces them in its optimizer step)")
        b, a = r["check_before"], r["check_after"]

        def deltas(d):
            return ", ".join(f"{n} {abs(d[n] - d['single']):.1e}" for n in ("ours", "torch")
                             if n in d)
        outs = ", ".join(f"{n} {b[n + '_out']:.1e}" for n in ("ours", "torch") if n in b)
        lines.append(f"  sp {sp}: check vs one rank: loss {b['single']:.6f} at step 0, |diff| "
                     f"{deltas(b)}; max |output diff| {outs}; after {r['sgd_steps']} SGD steps "
                     f"loss {a['single']:.6f}, |diff| {deltas(a)}")
        if r["torch_error"]:
            lines.append(f"  sp {sp}: torch TP did not run: {r['torch_error']}")
        cpu = r["cpu_s"]
        lines.append(f"  sp {sp}: cpu ms/step (process time of every thread, median, largest "
                     f"rank; one rank: rank 0): " + ", ".join(
                         f"{n} {cpu[k] * 1e3:.1f}" for k, n in
                         (("ours", "ours"), ("torch", "torch"), ("single", "one rank"))
                         if k in cpu))
        lines.append(f"  sp {sp}: every timed step, ms: ours "
                     + " ".join(f"{t * 1e3:.0f}" for t in r["step_s"]["ours"])
                     + ("; torch " + " ".join(f"{t * 1e3:.0f}" for t in r["step_s"]["torch"])
                        if "torch" in r["step_s"] else "")
                     + "; one rank " + " ".join(f"{t * 1e3:.0f}" for t in r["step_s"]["single"]))
    return lines


def run(layers: int = 4, d_model: int = 512, heads: int = 8, seq_len: int = 256,
        batch: int = 4, steps: int = 5, warmup: int = 2, sequence_parallel: str = "both",
        torch_compare: bool = True, lr: float = 0.05, json_path: str = "") -> int:
    """Time each configuration; rank 0 prints the table (and writes json_path if given)."""
    import json

    from hpctrain.runtime.mesh import MeshLayout
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
    if heads % n or seq_len % n:
        raise SystemExit(f"bench tp: at tp={n} the heads ({heads}) and the sequence length "
                         f"({seq_len}) must be divisible by {n}")
    from hpctrain.bench.pipeline import _shared_cores

    load0, shared = os.getloadavg()[0], _shared_cores(world)
    mesh = world.mesh(MeshLayout(tp=n, dp=1))
    torch_mesh, torch_err = None, ""
    if torch_compare:
        try:
            from torch.distributed.device_mesh import init_device_mesh

            from hpctrain.bench.workload import _init_gloo

            _init_gloo(world)
            torch_mesh = init_device_mesh("cpu", (n,))
        except Exception as exc:
            torch_err = f"{type(exc).__name__}: {exc}"
    rows = [_config(world, mesh, torch_mesh, sp, layers, d_model, heads, seq_len, batch,
                    steps, warmup, lr, torch_err)
            for sp in SP_CHOICES[sequence_parallel]]
    if world.rank == 0:
        header = {"layers": layers, "d_model": d_model, "heads": heads, "seq_len": seq_len,
                  "batch": batch, "steps": steps, "warmup": warmup, "ranks": n,
                  "load0": load0, "load1": os.getloadavg()[0], "shared": shared,
                  "cores": len(_node_cores())}
        print("\n".join(report(rows, header)), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"bench": "tp", **header, "target": TARGET, "rows": rows}, f,
                          indent=1)
                f.write("\n")
            print(f"  wrote {json_path}")
    if torch_mesh is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    world.mpi_comm.Barrier()
    return 0
