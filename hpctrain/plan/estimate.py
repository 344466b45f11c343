"""Per-rank bytes of a plan: model states (ZeRO paper), activations (Megatron's formula in
hpctrain's form), communication per step. Pure arithmetic over a ModelShape.

Model states, Ψ parameters a rank's stage holds (after the tp split), N ranks sharding them,
bytes per parameter (p, g, o) from ``state_bytes`` (fp32 AdamW: 4+4+8; mixed: 2+2+12, K=12):
  ddp, fsdp NO_SHARD     pΨ + gΨ + oΨ                   (16Ψ fp32 / mixed)
  zero1                  pΨ + gΨ + oΨ/N                 (4Ψ + 12Ψ/N mixed)
  zero2                  pΨ + (g+o)Ψ/N                  (2Ψ + 14Ψ/N mixed)
  fsdp SHARD_GRAD_OP     (p+g+o)Ψ/N + pΨ gathered       (stage 2, the shard kept besides)
  zero3                  (p+g+o)Ψ/N + p·(largest unit)  (16Ψ/N + one gathered unit)
  fsdp                   (p+g+o)Ψ/N + 2p·(largest unit) (the next unit is prefetched, when
                                                          it fits allgather_bucket_size)
  fsdp HYBRID            as fsdp with N = ranks per node (replicas across nodes)
Buffers: zero2, zero3 and fsdp reduce-scatter gradients during backward through piece buffers
of at most B = reduce_bucket_size bytes alive at once, and the MPI backend stages (N-1)/N of
the pieces in flight to receive them: B + B·(N-1)/N (``reduction_buffer_bytes``), next to the
full gradients of the unit whose backward runs (g·unit; gΨ under grad accumulation, kept
from the first micro-batch to the last); zero1's step reduce-scatter: 3g·unit/N.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field

import torch

from hpctrain.parallel.pipeline import schedule as pipe_schedule
from hpctrain.parallel.sharding.reduction import reduction_buffer_bytes
from hpctrain.plan.candidates import Candidate, Request

__all__ = ["Estimate", "estimate", "state_bytes", "gpt_layer_activation",
           "MEGATRON_FORMULA"]

MEGATRON_FORMULA = "s·b·h·(34 + 5·a·s/h)"


def state_bytes(precision: str, optimizer: str, momentum: float = 0.0,
                autocast: bool = False) -> tuple:
    """(param, grad, optimizer) bytes per parameter, as in the ZeRO paper: mixed precision
    keeps fp16/bf16 params and grads plus an fp32 master copy in the optimizer state.
    ``autocast``: hpctrain's own bf16/fp16, autocast over fp32 params, grads and state."""
    mixed = precision in ("bf16", "fp16") and not autocast
    p = g = 2 if mixed else 4
    return p, g, optimizer_state_bytes(optimizer, momentum) + (4 if mixed else 0)


@functools.lru_cache(maxsize=None)
def optimizer_state_bytes(optimizer: str, momentum: float = 0.0) -> int:
    """Bytes of optimizer state per fp32 parameter element, measured rather than tabled: the
    torch.optim class (any, by name: AdamW 8, SGD 0 or 4 with momentum, Adagrad 4, Adadelta
    8, ...) stepped twice over a probe parameter, counting the state tensors shaped like it
    (per-parameter scalars such as ``step`` are negligible). ValueError for an unknown name."""
    from hpctrain.config import ConfigError
    from hpctrain.train.optimizers import UNDRIVABLE, optimizer_class

    try:
        cls = optimizer_class(optimizer)
    except ConfigError as exc:
        raise ValueError(str(exc).replace("train.optimizer", "--optimizer")) from None
    if cls.__name__ in UNDRIVABLE:
        raise ValueError(f"optimizer {cls.__name__}: hpctrain cannot train with it "
                         f"({UNDRIVABLE[cls.__name__]})")
    probe = torch.nn.Parameter(torch.zeros(64))
    kwargs = {"lr": 1e-3}
    if "momentum" in inspect.signature(cls).parameters:
        kwargs["momentum"] = momentum
    opt = cls([probe], **kwargs)
    for _ in range(2):
        probe.grad = torch.ones(64)
        opt.step()
    state = opt.state[probe].values()
    return sum(t.element_size() * t.numel() // probe.numel() for t in state
               if torch.is_tensor(t) and t.shape == probe.shape)


def activation_bytes(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def gpt_layer_activation(s: int, h: int, a: int, e: int, t: int = 1, sp: bool = False) -> float:
    """Bytes one GPT block saves per sample: hpctrain's block with fused attention (SDPA)
    and no dropout keeps s·(16h + a + 4) elements of e bytes (Megatron's 34 = 2·17 counts
    two dropout masks and an unfused attention's 5·a·s/h on top). With tp = t: the LayerNorm
    regions (4 of the 16) stay whole, the rest splits; with sequence parallel the LayerNorm
    inputs split too, while each column-parallel linear keeps its gathered input."""
    if t == 1:
        return e * s * (16 * h + a + 4)
    whole = (2 + 2 / t) if sp else 4
    return e * s * (h * (whole + 12 / t) + (4 / t if sp else 4) + a / t)


@dataclass
class Estimate:
    """Bytes per rank (the busiest rank) of one plan."""

    candidate: Candidate
    params: float
    grads: float
    optimizer: float
    gathered: float
    buffers: float  # the gradient reduction's in-flight buffers (reduce_bucket_size)
    activations: float
    activations_ac: float
    activations_kept: float  # with checkpointing, less one layer's recompute in backward
    comm: float
    limit: float
    psi_rank: int
    formulas: dict = field(default_factory=dict)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered + self.buffers

    @property
    def total(self) -> float:
        return self.states + self.activations

    @property
    def total_ac(self) -> float:
        return self.states + self.activations_ac

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    @property
    def fits_with_ac(self) -> bool:
        return self.total_ac <= self.limit

    @property
    def needed(self) -> float:
        return min(self.total, self.total_ac)


def _stages(shape, c: Candidate) -> list:
    """Layer indices of each stage, split by parameter count as the pipeline does."""
    if c.pp == 1:
        return [list(range(len(shape.layers)))]
    from hpctrain.parallel.pipeline.plan import balanced_split, stage_layers

    counts = [shape.params([i]) for i in range(len(shape.layers))]
    return stage_layers(balanced_split(counts, c.pp), len(shape.layers))


def _shard_group(c: Candidate, req: Request) -> int:
    if c.sharding == "HYBRID_SHARD":
        return min(c.dp, req.ranks_per_node)
    return c.dp


def _states(c: Candidate, req: Request, psi: int, unit: int) -> tuple:
    p, g, o = state_bytes(req.precision, req.optimizer, req.momentum, req.autocast)
    n = _shard_group(c, req)
    kind = c.dp_label if c.dp > 1 else "ddp"
    if kind in ("ddp", "single"):
        return p * psi, g * psi, o * psi, 0, "pΨ + gΨ + oΨ"
    if kind == "zero1":
        return p * psi, g * psi, o * psi / n, 0, "pΨ + gΨ + oΨ/N"
    if kind == "zero2":
        return p * psi, g * psi / n, o * psi / n, 0, "pΨ + gΨ/N + oΨ/N"
    if kind == "fsdp:SHARD_GRAD_OP":  # every unit stays gathered from forward to backward
        return p * psi / n, g * psi / n, o * psi / n, p * psi, "(p+g+o)Ψ/N + pΨ gathered"
    if kind == "zero3":
        return p * psi / n, g * psi / n, o * psi / n, p * unit, "(p+g+o)Ψ/N + p·unit"
    # fsdp FULL_SHARD / HYBRID: backward_prefetch gathers the next unit before this one ends
    # (only a unit that fits allgather_bucket_size)
    if p * unit > req.allgather_bucket_size:
        return p * psi / n, g * psi / n, o * psi / n, p * unit, \
            "(p+g+o)Ψ/N + p·unit (a unit > allgather_bucket_size: no prefetch)"
    return p * psi / n, g * psi / n, o * psi / n, 2 * p * unit, "(p+g+o)Ψ/N + 2p·unit"


def _buffers(c: Candidate, req: Request, psi: int, unit: int) -> tuple:
    """(bytes, formula) of the transients the sharded flavours hold besides their states:
    zero2, zero3 and fsdp's sharded flavours reduce-scatter during backward over N > 1
    ranks, through buffers of at most B = reduce_bucket_size alive at once plus what the MPI
    backend stages to receive (B·(N-1)/N), next to the full gradients of the unit whose
    backward runs (every unit's under grad accumulation: the earlier micro-batches keep
    them); zero1 reduce-scatters each unit whole at the step (the result and the ring's
    two chunks: 3 shards of a unit); ddp fuses in Horovod's buffer, not priced here."""
    n = _shard_group(c, req)
    kind = c.dp_label if c.dp > 1 else "ddp"
    _, g, _ = state_bytes(req.precision, req.optimizer, req.momentum, req.autocast)
    if kind in ("ddp", "single") or n <= 1:
        return 0, "0"
    if kind == "zero1":
        return 3 * g * unit / n, "3g·unit/N (the step's reduce-scatter)"
    b = req.reduce_bucket_size
    grads, text = (g * psi, "gΨ") if req.grad_accum > 1 else (g * unit, "g·unit")
    return reduction_buffer_bytes(b, n) + grads, \
        f"B + B·(N-1)/N + {text} (B = reduce_bucket_size = {b:,}; full gradients until " \
        f"their reduction{', all of them under grad accumulation' if req.grad_accum > 1 else ''})"


def _gpt_layer(shape, i: int, e: int, c: Candidate) -> tuple:
    """(saved, input, loss) bytes per sample of layer i of the analytic GPT."""
    d, t, sp = shape.gpt, c.tp, c.sequence_parallel
    s, h = d.seq, d.hidden
    chunk = t if sp else 1  # sequence parallel: the residual stream is a sequence chunk
    info = shape.layers[i]
    if info.is_block:
        return gpt_layer_activation(s, h, d.heads, e, t, sp), e * s * h / chunk, 0.0
    if info.name == "embed":
        return 8 * s, 8 * s, 0.0  # the token ids (int64) the embedding keeps
    # ln_f keeps its input (a chunk under sp) and the head its gathered input; the loss
    # keeps the log-softmax of this rank's vocabulary slice and the targets
    return e * s * (h / chunk + h + 2 / chunk), e * s * h / chunk, e * s * d.vocab / t + 8 * s


def _stage_bytes(shape, stage: list, e: int, c: Candidate, pipeline: bool) -> tuple:
    """Per sample of one micro-batch on a stage: (saved without checkpointing, kept with
    it, the largest layer recomputed at once)."""
    last = len(shape.layers) - 1
    if shape.gpt is not None:
        rows = [_gpt_layer(shape, i, e, c) for i in stage]
        full = sum(r[0] for r in rows) + sum(r[2] for r in rows)
        fulls = [r[0] for r in rows]
    else:  # the meta forward's storages (fp32), counted once per stage
        scale, layers = e / 4, shape.layers_at(c.tp)  # a tp rank's share, priced split
        loss_saved = layers[last].loss_saved if last in stage else {}
        union = {k: b for i in stage for k, b in layers[i].saved.items()}
        rows = [(sum(layers[i].saved.values()) * scale,
                 layers[i].input_bytes * scale, 0.0) for i in stage]
        if rows and loss_saved:  # under checkpointing the loss keeps what it saves itself
            rows[-1] = (rows[-1][0], rows[-1][1], sum(loss_saved.values()) * scale)
        full = sum({**union, **loss_saved}.values()) * scale
        fulls = [r[0] for r in rows]
    recomputed = [f for i, f in zip(stage, fulls) if pipeline or shape.layers[i].is_block]
    loss = sum(r[2] for r in rows)
    if pipeline:  # every layer recomputes; each keeps its input
        kept = sum(r[1] for r in rows) + loss
    else:  # blocks keep their input, the rest all it saves
        kept = loss
        for i, r in zip(stage, rows):
            inner = shape.layers_at(c.tp)[i].inner_blocks
            if shape.layers[i].is_block:
                kept += r[1]
            else:  # blocks nested inside: each keeps its input instead of what it saves
                kept += r[0] - sum(b[1] - b[2] for b in inner) * e / 4
                recomputed += [b[1] * e / 4 for b in inner]
    return full, kept, max(recomputed, default=0.0)


def _input_bytes(shape, e: int) -> float:
    """Bytes per sample of the model's input (token ids: int64)."""
    if shape.gpt is not None:
        return 8.0 * shape.gpt.seq
    return shape.layers[0].input_bytes * e / 4


def _activations(shape, c: Candidate, req: Request, stages: list) -> tuple:
    """Bytes on the busiest rank: (without checkpointing, with it, with it but without the
    one layer recomputed at a time), the micro-batch and the micro-batches alive per stage."""
    e = activation_bytes(req.precision)
    if c.pp > 1:
        b = req.global_batch / (req.grad_accum * c.dp * req.microbatches)
        schedules = pipe_schedule.build(c.schedule, c.pp, req.microbatches)
        live = [pipe_schedule.peak_live(a) for a in schedules]
    else:
        b = math.ceil(req.global_batch / (req.grad_accum * max(c.dp, 1)))
        live = [1]
    worst, worst_ac, worst_kept = 0.0, 0.0, 0.0
    for stage, k in zip(stages, live):
        full, kept, transient = _stage_bytes(shape, stage, e, c, c.pp > 1)
        # The first stage's micro-batches are views of the replica's batch, which stays
        # whole while any of them is saved: all m micro-batches of input, not k.
        batch = (req.microbatches - k) * b * _input_bytes(shape, e) \
            if c.pp > 1 and 0 in stage else 0.0
        worst_ac = max(worst_ac, k * b * kept + batch + b * transient)
        worst_kept = max(worst_kept, k * b * kept + batch)
        worst = max(worst, k * b * full + batch)
    return worst, worst_ac, worst_kept, b, live


def _comm(shape, c: Candidate, req: Request, psi: int, stages: list, b: float) -> tuple:
    """Payload bytes a rank sends into collectives / p2p per optimizer step, and formula."""
    p, g, _ = state_bytes(req.precision, req.optimizer, req.momentum, req.autocast)
    parts, text = 0.0, []
    kind = c.dp_label
    if c.dp > 1:
        if kind in ("zero3", "fsdp"):
            parts += 2 * p * psi + g * psi
            text.append("3Ψ (2 all-gathers + reduce-scatter)")
        elif kind == "fsdp:HYBRID":
            n = _shard_group(c, req)
            parts += 2 * p * psi + g * psi + 2 * g * psi / n
            text.append("3Ψ in node + 2Ψ/N across nodes")
        else:
            parts += 2 * g * psi
            text.append("2Ψ (reduce-scatter + all-gather)")
    e = activation_bytes(req.precision)
    micro = req.grad_accum * (req.microbatches if c.pp > 1 else 1)
    boundary = _boundary_bytes(shape, stages, e)
    if c.tp > 1 and shape.gpt is not None:
        d = shape.gpt
        layers = max(sum(shape.layers[i].is_block for i in st) for st in stages)
        parts += 4 * layers * b * d.seq * d.hidden * e * micro
        text.append("tp: 4·L·s·b·h per micro-batch")
    if c.pp > 1:
        parts += 2 * b * boundary * micro
        text.append("pp: 2·s·b·h per micro-batch")
    return parts, " + ".join(text) or "none"


def _boundary_bytes(shape, stages: list, e: int) -> float:
    """Bytes per sample crossing a stage boundary (the activation sent forward)."""
    if shape.gpt is not None:
        return e * shape.gpt.seq * shape.gpt.hidden
    return max((shape.layers[st[-1]].output_bytes * e / 4 for st in stages[:-1]), default=0.0)


def estimate(shape, c: Candidate, req: Request) -> Estimate:
    """Price candidate c for the request; the busiest stage stands for every rank."""
    stages = _stages(shape, c)
    splits = shape.tp_splits(c.tp) if c.tp > 1 else None
    per_stage = [(shape.params(st, splits, c.tp), max(shape.units(st, splits, c.tp)))
                 for st in stages]
    psi, unit = max(per_stage)
    pb, gb, ob, gathered, states_formula = _states(c, req, psi, unit)
    buffers, buffers_formula = _buffers(c, req, psi, unit)
    act, act_ac, kept, b, live = _activations(shape, c, req, stages)
    comm, comm_formula = _comm(shape, c, req, psi, stages, b)
    p, g, o = state_bytes(req.precision, req.optimizer, req.momentum, req.autocast)
    formulas = {"states": f"{states_formula} with p={p}, g={g}, o={o}, "
                          f"N={_shard_group(c, req)}, Ψ={psi:,}",
                "activations": f"micro-batch b={b:g} x {max(live)} in flight",
                "buffers": buffers_formula,
                "comm": comm_formula}
    return Estimate(c, pb, gb, ob, gathered, buffers, act, act_ac, kept, comm,
                    req.memory_gb * 1e9, psi, formulas)
