"""The pipeline strategy: this rank's stage(s), the schedule, and gradient sync over dp."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.errors import UsageError
from hpctrain.models.layers import LayerStack, from_sequential
from hpctrain.parallel.base import OptimizerFactory, Parallelized
from hpctrain.parallel.pipeline import plan, schedule as sched
from hpctrain.parallel.pipeline.dp_shards import DP_SHARDINGS, DPShards
from hpctrain.parallel.pipeline.engine import Engine
from hpctrain.parallel.pipeline import p2p_plan
from hpctrain.parallel.pipeline.p2p import P2P_MODES, StageLinks, ordered_mode
from hpctrain.parallel.sharding.engine import broadcast_state

__all__ = ["PipelineOptions", "Pipelined", "wrap", "resolve_layout"]


@dataclass
class PipelineOptions:
    """Typed options of the pipeline strategy (from the [pipeline] config table)."""

    mesh: object = ""               # a MeshLayout (the plan's); '' -> pp = world size
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 2         # chunks per rank, interleaved-1f1b only
    balance: str = "param-count"    # or "measured"
    split_points: str = ""
    activation_checkpointing: bool = False
    dp_sharding: str = "ddp"        # gradients over dp: ddp all-reduce, or zero1/zero2 shards
    p2p: str = "auto"               # issue order: eager (CPU), ordered (NCCL); auto by device
    sample: object = None           # one micro-batch input, for balance="measured"
    sample_target: object = None    # its target and the loss: "measured" times the loss
    loss_fn: object = None          # with the last layer, as the last stage runs it

    @property
    def chunks(self) -> int:
        return self.virtual_stages if self.schedule == "interleaved-1f1b" else 1


def resolve_layout(mesh, world_size: int):
    """The mesh layout of a pipeline run: a MeshLayout (the orchestrator passes the plan's),
    or for the Python API a string; '' means every rank is a stage (pp = world size)."""
    from hpctrain.runtime.mesh import MeshLayout

    if not isinstance(mesh, MeshLayout):
        mesh = MeshLayout.parse(mesh or f"pp={world_size},dp=1")
    layout = mesh.resolve(world_size)
    if layout.tp != 1 or layout.dom_size != 1:
        raise ValueError(f"mesh {layout.describe()}: the pipeline strategy uses only pp and dp; "
                         "set tp=1 and dom=1")
    return layout


class Pipelined(Parallelized):
    """A rank's pipeline stage(s) with their optimizer; forward_backward runs the schedule."""

    name = "pipeline"

    def __init__(self, stack, root: nn.Module, owned: list[int], engine: Engine, actions,
                 optimizer, pp, dp, tied_comm, tied_local: list, opts: PipelineOptions,
                 shards=None, job_comm=None):
        super().__init__(root, optimizer, job_comm)
        self.shards = shards            # DPShards (zero1/zero2 over dp) or None (ddp)
        self._grad_bytes = 0
        self.stack, self.owned, self.engine, self.actions = stack, owned, engine, actions
        self.pp, self.dp, self.tied_comm, self.tied_local = pp, dp, tied_comm, tied_local
        self.opts = opts
        self.is_last = engine.rank == engine.p - 1
        self._skeleton = None

    # -- data: ranks of one pipeline share the data of their dp replica --
    def data_shard(self, world) -> tuple[int, int]:
        """The dp replica's share: every stage of a pipeline reads the same samples (local)."""
        return self.dp.rank, self.dp.size

    def forward_backward(self, micro_batches, loss_fn, precision) -> float:
        """Cut each micro-batch into pipeline.microbatches pieces and run the schedule
        (collective: the stages exchange activations and gradients)."""
        m, local = self.opts.microbatches, 0.0
        for (x, y, weight), last in _with_last(micro_batches):
            n = x.shape[0]
            if n % m:
                raise ValueError(f"pipeline: a micro-batch of {n} samples does not split into "
                                 f"pipeline.microbatches = {m} equal parts; make "
                                 f"global_batch_size divisible by dp x grad_accum x {m}")
            xs, ys = x.split(n // m), y.split(n // m)
            micro = [(a, b, weight / m) for a, b in zip(xs, ys)]
            if self.shards is not None:  # zero2 reduces during the step's last run only
                self.shards.begin_run(final=last)
            local += self.engine.run(self.actions, micro, loss_fn, precision)
        return local if self.is_last else 0.0

    # -- gradients: tied copies summed between their stages, then summed over dp --
    def _sync_grads(self) -> None:
        if self.tied_comm is not None:
            for p in self.tied_local:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.tied_comm.allreduce(p.grad)
        if self.dp.size > 1:
            params = [p for p in self.model.parameters() if p.requires_grad]
            had = [p.grad is not None for p in params]
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # One all-reduce: the gradients, then a had-a-gradient flag per parameter.
            flat = torch.cat([p.grad.reshape(-1) for p in params] +
                             [torch.tensor(had, dtype=params[0].grad.dtype)]) if params else None
            if flat is not None:
                self.dp.allreduce(flat)  # weights already hold each replica's share: sum
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            # No gradient on any replica (an unused parameter): none, as in one process, so
            # weight decay and momentum leave it alone.
            for p, flag in zip(params, flat[off:].tolist() if params else []):
                if flag == 0:
                    p.grad = None
        self._grad_bytes = sum(p.grad.numel() * p.grad.element_size()
                               for p in self.model.parameters() if p.grad is not None)

    def step(self, scaler=None, max_grad_norm: float = 0.0) -> None:
        """ddp: the base step over full gradients; zero1/zero2: the shards step (dp_shards);
        collective."""
        if self.shards is None:
            return super().step(scaler, max_grad_norm)
        return self.shards.step(scaler, max_grad_norm)

    def memory_report(self) -> dict:
        """Bytes this rank holds for params, gradients (alive at the last step) and optimizer
        state; with dp_sharding zero1/zero2 the optimizer (and zero2 grads) are 1/dp; local."""
        if self.shards is not None:
            rep = self.shards.memory_report()
        else:
            from hpctrain.parallel.sharding.engine import nbytes

            rep = {"dp_sharding": "ddp", "dp": self.dp.size,
                   "params": nbytes(list(self.model.parameters())), "grads": self._grad_bytes,
                   "optimizer": nbytes([v for st in self.optimizer.state.values()
                                        for v in st.values() if torch.is_tensor(v)])}
        return {"strategy": self.name, "pp": self.pp.size, **rep}

    def _canonical(self):
        """Local parameters that are not a tied copy of a parameter owned elsewhere."""
        return [(n, p) for n, p in self.model.named_parameters() if n not in self.stack.tied]

    def _pp_sum(self, value: float) -> float:
        return self.pp.allreduce_scalars([value])[0] if self.pp.size > 1 else value

    def _grad_norm(self) -> float:
        if self.shards is not None:
            return self.shards.grad_norm()
        sq = sum(float(p.grad.detach().double().pow(2).sum()) for _, p in self._canonical()
                 if p.grad is not None)
        return math.sqrt(self._pp_sum(sq))

    def param_norm(self) -> float:
        """Global L2 norm of the whole model's parameters (stages summed); collective."""
        with torch.no_grad():
            sq = sum(float(p.detach().double().pow(2).sum()) for _, p in self._canonical())
        return math.sqrt(self._agree(self._pp_sum(sq)))

    def buffer_norm(self) -> float:
        """Global L2 norm of the whole model's floating buffers (stages summed); collective."""
        with torch.no_grad():
            sq = sum(float(b.detach().double().pow(2).sum()) for b in self.model.buffers()
                     if b.is_floating_point())
        return math.sqrt(self._agree(self._pp_sum(sq)))

    # -- checkpoints: every rank describes every tensor of the WHOLE model --
    def _whole(self) -> nn.Module:
        if self._skeleton is None:
            with torch.device("meta"):
                self._skeleton = self.stack.build(range(len(self.stack)))
        return self._skeleton

    def _my_span(self, n: int) -> tuple[int, int]:
        return self.dp.rank * n // self.dp.size, (self.dp.rank + 1) * n // self.dp.size

    def _entry(self, name, shape, dtype, tensor):
        from hpctrain.checkpoint.layout import Entry, numel

        if tensor is None:
            return Entry(name, shape, dtype, None, elems=(0, 0))
        lo, hi = self._my_span(numel(shape))
        return Entry(name, shape, dtype, tensor.detach().reshape(-1)[lo:hi], elems=(lo, hi))

    def _optim_descr(self) -> list:
        """(param name, key, shape, dtype) of every optimizer tensor of the WHOLE model."""
        if self.shards is not None:  # state of flat shards, named by the params behind them
            mine = self.shards.local_optim_descr({n for n, _ in self._canonical()})
        else:
            mine = [[name, k, list(v.shape), str(v.dtype).replace("torch.", "")]
                    for name, p in self._canonical()
                    for k, v in sorted(self.optimizer.state.get(p, {}).items())
                    if torch.is_tensor(v)]
        seen, merged = set(), {}
        for per_rank in _allgather_json(self.pp, mine):
            for name, k, shape, dtype in per_rank:
                if (name, k) not in seen:
                    seen.add((name, k))
                    merged.setdefault(name, []).append((k, tuple(shape), getattr(torch, dtype)))
        order = [n for n, _ in self._whole().named_parameters()]
        return [(n, k, s, d) for n in order for k, s, d in sorted(merged.get(n, []))]

    def state_entries(self) -> list:
        local = dict(self.model.state_dict(keep_vars=True))
        entries, seen = [], set()
        for key, t in self._whole().state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            entries.append(self._entry(f"model/{key}", tuple(t.shape), t.dtype, local.get(key)))
        params = dict(self._canonical())
        for name, k, shape, dtype in self._optim_descr():
            if self.shards is not None:
                entries.append(self.shards.optim_entry(name, k, shape, dtype, set(params)))
                continue
            p = params.get(name)
            v = self.optimizer.state.get(p, {}).get(k) if p is not None else None
            entries.append(self._entry(f"optim/{name}/{k}", shape, dtype, v))
        return entries

    def _full_state(self) -> dict:
        """The whole model's state: each tensor broadcast over pp from the first stage that
        holds it (collective over the pipeline group; dp replicas hold the same values)."""
        local = self.model.state_dict(keep_vars=True)
        held = [set(keys) for keys in _allgather_json(self.pp, sorted(local))]
        whole = self._whole().state_dict(keep_vars=True)
        keys_of: dict = {}
        for key, t in whole.items():
            keys_of.setdefault(id(t), (t, []))[1].append(key)  # tied: one tensor, several keys
        out = {}
        for t, keys in keys_of.values():
            src = next((r for r, h in enumerate(held) if h.intersection(keys)), None)
            if src is None:
                raise RuntimeError(f"no pipeline stage holds {keys}; the stages do not cover "
                                   "the model")
            if src == self.pp.rank:
                buf = local[next(k for k in keys if k in local)].detach().to(self.pp.device,
                                                                              copy=True)
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device=self.pp.device)
            self.pp.broadcast(buf, root=src)
            value = buf.cpu()
            out.update({k: value for k in keys})
        return {k: out[k] for k in whole}

    def state_meta(self) -> dict:
        whole = self._whole()
        names = [n for n, _ in whole.named_parameters()]
        return self._state_meta(whole, lambda g: names)

    def load_state_entries(self, reader) -> None:
        """Load this rank's layers (tied copies from their owner's name) and their optimizer
        state from a checkpoint written by any strategy at any depth."""
        from hpctrain.checkpoint.layout import from_numpy

        tied = self.stack.tied
        with torch.no_grad():
            for key, t in self.model.state_dict(keep_vars=True).items():
                a = reader.read(f"model/{tied.get(key, key)}", tuple(t.shape))
                if a is not None:
                    t.copy_(from_numpy(a, t.dtype).reshape(t.shape))
        if self.shards is not None:
            if self._optim_class_matches(reader):
                self.shards.load_optimizer(reader, tied)
                self._load_param_groups(reader)
            return
        self._load_optimizer_state(
            reader, ((tied.get(name, name), p) for name, p in self.model.named_parameters()))


def _with_last(items):
    """(item, is it the last one) over an iterable, looking one item ahead."""
    it = iter(items)
    try:
        cur = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield cur, False
        cur = nxt
    yield cur, True


def _allgather_json(comm, obj) -> list:
    """Every rank's JSON-able obj, in rank order (collective over comm; tensors only)."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=comm.device)
    if comm.size == 1:
        return [obj]
    n = torch.tensor([data.numel()], dtype=torch.int64, device=comm.device)
    sizes = comm.allgather(n).tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=comm.device)
    buf[:data.numel()] = data
    out = comm.allgather(buf).view(comm.size, -1).cpu()
    return [json.loads(bytes(out[r, :sizes[r]].tolist()).decode()) for r in range(comm.size)]


def _layer_costs(stack, opts: PipelineOptions, pp, dp):
    """Per-layer cost: parameter count, or forward+backward seconds measured on each pipeline
    rank (one list per rank: the split gives a slower rank fewer layers). All ranks measure
    at once, as they compute in the steady state (one rank timing while the others wait in a
    collective would time it under their polling); replicas over dp keep their slowest time,
    so every rank computes the same split. Given a sample target and the loss, the last layer
    is timed with the loss on its output, since the last stage computes it: a costly loss
    (a large vocabulary's cross-entropy) then leaves that stage fewer layers."""
    if opts.balance == "param-count":
        return [float(c) for c in stack.param_counts()]
    if opts.sample is None:
        raise ValueError("pipeline.balance = 'measured' needs a sample micro-batch")
    costs = torch.zeros(1, len(stack), dtype=torch.float64, device=pp.device)
    x, target, loss_fn = opts.sample, opts.sample_target, opts.loss_fn
    with_loss = loss_fn is not None and target is not None
    for i, layer in enumerate(stack.layers):
        root = stack.build([i]).to(x.device)
        # A Sequential's layers are the model's own modules: time them without training them.
        before = {k: v.detach().clone() for k, v in root.state_dict().items()}
        times = []
        for _ in range(3):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            out = layer.forward(root, inp)
            if with_loss and i == len(stack) - 1:
                loss_fn(out, target).backward()
            else:
                out.float().sum().backward()
            times.append(time.perf_counter() - t0)
        costs[0, i] = sorted(times)[1]
        x = out.detach()
        with torch.no_grad():
            for k, v in root.state_dict().items():
                v.copy_(before[k])
        root.zero_grad(set_to_none=True)
        del root
    if dp.size > 1:
        dp.allreduce(costs, op="max")
    if pp.size > 1:
        costs = pp.allgather(costs)
    return costs.tolist()


def _as_stack(model) -> LayerStack:
    """A LayerStack as given; an nn.Sequential one layer per child (ties declared)."""
    if isinstance(model, LayerStack):
        return model
    if isinstance(model, nn.Module):
        return from_sequential(model)  # TypeError naming what is expected for other modules
    raise TypeError(f"the pipeline strategy takes an nn.Sequential or a models.layers.LayerStack, "
                    f"got {type(model).__name__}")


def _tied_copies(stack: LayerStack, root: nn.Module) -> dict:
    """{owner's name: this rank's copy} of the trainable parameters tied across stages."""
    local = dict(root.named_parameters(remove_duplicate=False))
    out = {}
    for alias, owner in stack.tied.items():
        has_alias, has_owner = alias in local, owner in local
        shared = has_alias and has_owner and local[alias] is local[owner]
        p = local[alias if has_alias else owner] if has_alias or has_owner else None
        if p is not None and not shared and p.requires_grad:
            out.setdefault(owner, p)
    return out


def _check_tied_groups(pp, copies: dict) -> None:
    """Every stage holding a tied copy must hold the same ones: their gradients are summed
    in one group, tensor by tensor (collective over pp; all ranks raise alike)."""
    held = [names for names in _allgather_json(pp, sorted(copies)) if names]
    if any(names != held[0] for names in held):
        raise UsageError(f"parameters tied across pipeline stages form different groups "
                         f"({held}); the pipeline sums tied gradients over one group of stages "
                         f"only. Fix: tie one set of parameters (e.g. embedding and head), or "
                         f"set pipeline.split_points so tied layers share a stage")


def _tie_stages(stack: LayerStack, root: nn.Module, pp):
    """(communicator over the stages holding tied copies or None, this rank's copies): the
    copies start from the first holder's values, and the step sums their gradients over
    that communicator (collective over pp)."""
    copies = _tied_copies(stack, root)
    _check_tied_groups(pp, copies)
    tied_local = [copies[name] for name in sorted(copies)]  # one order on every holder
    flags = torch.tensor([1 if tied_local else 0], dtype=torch.int64, device=pp.device)
    holders = pp.allgather(flags).tolist() if pp.size > 1 else flags.tolist()
    if not any(holders):
        return None, tied_local
    sub = pp.split(0 if tied_local else None, key=pp.rank)
    if not tied_local:
        return None, tied_local
    with torch.no_grad():
        for t in tied_local:
            sub.broadcast(t.detach(), root=0)
    return sub, tied_local


def wrap(stack, make_optimizer: OptimizerFactory, world, options: PipelineOptions | None = None):
    """Build this rank's stage(s) of ``stack`` (a LayerStack, or an nn.Sequential split one
    layer per child) and the schedule (collective)."""
    opts = options or PipelineOptions()
    if opts.dp_sharding not in DP_SHARDINGS:  # pure: before any collective
        raise ValueError(f"pipeline.dp_sharding = {opts.dp_sharding!r}: expected one of "
                         f"{', '.join(DP_SHARDINGS)}")
    if opts.p2p not in P2P_MODES:
        raise ValueError(f"pipeline.p2p = {opts.p2p!r}: expected one of {', '.join(P2P_MODES)}")
    stack = _as_stack(stack)
    layout = resolve_layout(opts.mesh, world.size)
    p, v = layout.pp, opts.chunks
    plan.check_fits(len(stack), p, v, opts.schedule)       # pure: before any collective
    actions_all = sched.build(opts.schedule, p, opts.microbatches, v)
    ordered = ordered_mode(opts.p2p, world.device, p)
    if ordered:  # NCCL matches by order and blocks sends: prove the order safe first
        p2p_plan.check_ordered(actions_all, v)
    names = [layer.name for layer in stack.layers]
    if opts.split_points:
        starts = plan.split_at(opts.split_points, names, p * v)
    else:
        starts = None
    mesh = world.mesh(layout)
    pp, dp = mesh.comm("pp"), mesh.comm("dp")
    if starts is None:
        starts = plan.balanced_split(_layer_costs(stack, opts, pp, dp), p * v)
    groups = plan.stage_layers(starts, len(stack))
    my_stages = [sched.stage_of(pp.rank, c, p) for c in range(v)]
    owned = [i for g in my_stages for i in groups[g]]
    root = stack.build(owned).to(world.device)
    chunks = [[stack.layers[i] for i in groups[g]] for g in my_stages]
    # One start everywhere, whatever the user's init did (a Sequential built on every rank).
    broadcast_state(root, dp)
    tied_comm, tied_local = _tie_stages(stack, root, pp)
    links = StageLinks(pp, p * v, world.device, ordered)
    engine = Engine(root, chunks, links, pp.rank, p, opts.activation_checkpointing)
    shards = None
    if opts.dp_sharding != "ddp":
        shards = DPShards(root, chunks, actions_all[pp.rank], stack.tied, dp, pp, tied_comm,
                          tied_local, opts.dp_sharding, make_optimizer)
        engine.after_backward = shards.after_backward
    optimizer = shards.optimizer if shards is not None else make_optimizer(root.parameters())
    par = Pipelined(stack, root, owned, engine, actions_all[pp.rank], optimizer, pp, dp,
                    tied_comm, tied_local, opts, shards, world.host)
    if world.is_main:
        split = " | ".join(f"{g}:{names[grp[0]]}..{names[grp[-1]]}" for g, grp in enumerate(groups))
        print(f"hpctrain: pipeline pp={p} dp={dp.size} schedule={opts.schedule} "
              f"microbatches={opts.microbatches} chunks/rank={v} dp_sharding={opts.dp_sharding} "
              f"p2p={'ordered' if ordered else 'eager'} "
              f"stages {split}", flush=True)
    return par
