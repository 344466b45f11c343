"""The pipeline transform: this rank's stage(s), the schedule, and the units the dp flavour
shards over each stage's replicas (it never reduces gradients itself)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.data.structure import map_tensors, rows, take_rows
from hpctrain.errors import UsageError
from hpctrain.models.chain import split_model
from hpctrain.models.layers import LayerStack, check_input, run_layer, split_input
from hpctrain.parallel.pipeline import plan, schedule as sched
from hpctrain.parallel.pipeline.engine import Engine
from hpctrain.parallel.pipeline.options import PipelineOptions
from hpctrain.parallel.pipeline import p2p_plan
from hpctrain.parallel.pipeline.p2p import P2P_MODES, StageLinks, ordered_mode
from hpctrain.parallel.placement import Copies, place, placement_of
from hpctrain.parallel.sharding.engine import broadcast_state

__all__ = ["PipelineOptions", "PipelineExecutor", "Probe", "prepare", "resolve_layout"]


@dataclass(frozen=True)
class Probe:
    """What the run hands the pipeline beside its options (the orchestrator builds it from
    the data set): ``sample``, one micro-batch input to time the layers on (balance =
    "measured") or to check a user module's split on; its ``target`` and the ``loss_fn``
    ("measured" times the last layer with the loss, as the last stage runs it); and
    ``unit_count``, target -> the units its loss is a mean over (train.loss_weight): a piece
    of a micro-batch counts by its share of them (None: by its rows)."""

    sample: object = None
    target: object = None
    loss_fn: object = None
    unit_count: object = None


def resolve_layout(mesh, world_size: int):
    """The mesh layout of a pipeline run: a MeshLayout (the orchestrator passes the plan's),
    or for the Python API a string; '' means every rank is a stage (pp = world size)."""
    from hpctrain.runtime.mesh import MeshLayout

    if not isinstance(mesh, MeshLayout):
        mesh = MeshLayout.parse(mesh or f"pp={world_size},dp=1")
    layout = mesh.resolve(world_size)
    if layout.dom_size != 1:
        raise ValueError(f"mesh {layout.describe()}: the pipeline strategy uses pp, dp and tp "
                         "(each stage tensor-parallel); set dom=1")
    return layout


class PipelineExecutor:
    """Runs this rank's stage(s): the schedule over each micro-batch's pieces, telling the
    dp flavour when a unit's layers are about to run (gather), have run (free) and have
    done their last backward of the step (reduce); names checkpoint entries for the WHOLE
    model (every rank describes every tensor; the stage holding one writes it)."""

    def __init__(self, stack, root: nn.Module, owned: list[int], engine: Engine, actions,
                 pp, dp, tied_comm, tied_local: list, opts: PipelineOptions, flavour: str,
                 unit_count=None):
        self.stack, self.root, self.owned, self.engine = stack, root, owned, engine
        self.actions = actions
        self.pp, self.dp, self.tied_comm, self.tied_local = pp, dp, tied_comm, tied_local
        self.opts, self.flavour, self.unit_count = opts, flavour, unit_count
        self.is_last = engine.rank == engine.p - 1
        self._skeleton = None
        self._piece = 0  # samples per schedule piece in training (0: none trained yet)
        self._specs = None
        self._unit_chunks: list[tuple] = []   # unit index -> chunks that use it
        self._trigger: list = []              # unit index -> action of its last backward

    # -- the units the dp flavour shards: the parameters each set of local chunks uses --
    def unit_specs(self) -> list:
        """UnitSpecs over this rank's trainable parameters: one per set of local chunks that
        use them, one per tied copy (last, in the stack's order, so the stages holding one
        shard it alike; its placement says its gradient is partial over the stages holding
        copies, summed at the step)."""
        from hpctrain.parallel.units import UnitSpec

        if self._specs is not None:
            return self._specs
        root, chunks = self.root, self.engine.chunks
        paths = [[q for layer in chunk for q in _layer_paths(layer)] for chunk in chunks]
        uses: dict[int, set] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            for c, qs in enumerate(paths):
                if any(name == q or name.startswith(q + ".") for q in qs):
                    uses.setdefault(id(p), set()).add(c)
        tied_ids = [id(p) for p in self.tied_local]
        groups: dict[tuple, list] = {}
        for name, p in root.named_parameters():
            if p.requires_grad and id(p) not in tied_ids:
                groups.setdefault(tuple(sorted(uses.get(id(p), ()))), []).append((name, p))
        names = {id(p): n for n, p in root.named_parameters()}
        specs = [UnitSpec(f"chunks{list(k)}", None, ps) for k, ps in groups.items()]
        chunk_sets = list(groups)
        for i, p in zip(tied_ids, self.tied_local):
            specs.append(UnitSpec(f"tied:{names[i]}", None, [(names[i], p)]))
            chunk_sets.append(tuple(sorted(uses.get(i, ()))))
        last_b = {}
        for i, a in enumerate(self.actions):
            if a.op == "B":
                last_b[a.chunk] = i
        self._unit_chunks = chunk_sets
        self._trigger = [max((last_b[c] for c in used if c in last_b), default=None)
                         for used in chunk_sets]
        self._specs = specs
        return specs

    @property
    def partial_groups(self) -> list:
        return []

    def name_of(self, local: str) -> str:
        """The checkpoint name of a local parameter or state key (a tied copy: its owner's)."""
        return self.stack.tied.get(local, local)

    # -- data: ranks of one pipeline share the data of their dp replica --
    def data_shard(self, world) -> tuple[int, int]:
        """The dp replica's share: every stage of a pipeline reads the same samples (local)."""
        return self.dp.rank, self.dp.size

    def load_batch(self, dataset, indices):
        from hpctrain.data.sampler import collate

        return collate(dataset, indices)

    def _units_of(self, chunk: int) -> list[int]:
        return [i for i, used in enumerate(self._unit_chunks) if chunk in used]

    def _bind(self, dp_part) -> None:
        """Connect the engine's action callbacks to the dp flavour's unit controls."""
        self.unit_specs()
        on_demand = dp_part.plan.on_demand
        reshard = dp_part.reshard_after_forward
        # Reduce in the step's last run right after a unit's last backward (stage >= 2:
        # gradients are sharded); zero1 and replicas reduce at the step.
        reduce_early = dp_part.plan.stage >= 2 and not dp_part.plan.persistent_grads
        by_chunk = {c: self._units_of(c) for c in range(len(self.engine.chunks))}
        triggered: dict[int, list] = {}
        for u, t in enumerate(self._trigger):
            if t is not None:
                triggered.setdefault(t, []).append(u)

        def before(index, action):
            if on_demand:
                dp_part.gather_units(by_chunk[action.chunk])

        def after(index, action):
            done = triggered.get(index, [])
            if reduce_early and done:
                dp_part.reduce_units(done)
            if not on_demand:
                return
            if action.op == "F" and reshard:
                dp_part.free_units(by_chunk[action.chunk])
            elif action.op == "B":
                # After the unit's last backward of this run, or (zero3, FULL_SHARD) after
                # every use: it is gathered again before its next one.
                dp_part.free_units([u for u in by_chunk[action.chunk] if reshard or u in done])

        self.engine.before_action, self.engine.after_action = before, after

    def forward_backward(self, dp_part, micro_batches, loss_fn, precision) -> float:
        """Cut each micro-batch into pipeline.microbatches pieces and run the schedule
        (collective: the stages exchange activations and gradients)."""
        if self.engine.after_action is None:
            self._bind(dp_part)
        m, local = self.opts.microbatches, 0.0
        for (x, y, weight), last in _with_last(micro_batches):
            n = rows(x)
            if n % m:
                raise ValueError(f"pipeline: a micro-batch of {n} samples does not split into "
                                 f"pipeline.microbatches = {m} equal parts; make "
                                 f"global_batch_size divisible by dp x grad_accum x {m}")
            self._piece = n // m  # evaluation cuts its batches to this (one shape per link)
            xs, ys = _pieces(x, n // m), _pieces(y, n // m)
            micro = [(a, b, weight * share) for a, b, share in zip(xs, ys, self._shares(ys, y))]
            dp_part.set_final(last)  # only the step's last run reduces
            local += self.engine.run(self.actions, micro, loss_fn, precision)
        return local if self.is_last else 0.0

    def _shares(self, pieces, whole) -> list:
        """Each piece's share of its micro-batch's loss units (rows, or valid tokens)."""
        count = self.unit_count
        if count is None:
            n = rows(whole)
            return [rows(p) / n for p in pieces]
        total = count(whole)
        return [count(p) / total if total else 0.0 for p in pieces]

    def forward_loss(self, dp_part, micro_batches, loss_fn, precision) -> float:
        """Evaluation (collective over the pipeline, and over dp for sharded units): each
        micro-batch cut into pieces of the training's piece size (the last padded with
        copies of a row: the links carry one shape), run forward-only; the loss of a piece
        counts only its real rows. This rank's units are gathered once for the whole
        evaluation rather than per action: the dp replicas' parts differ in size, so their
        piece counts do."""
        units = list(range(len(self.unit_specs())))
        dp_part.gather_units(units)
        p, v, rank = self.engine.p, self.engine.v, self.engine.rank
        local = 0.0

        def real_rows(out, y):  # a padded piece's loss: its real rows only
            return loss_fn(_first_rows(out, rows(y)), y)

        def pad(t, k):  # k more rows: copies of the first
            return torch.cat([t, t[:1].expand(k, *t.shape[1:])])

        try:
            for x, y, weight in micro_batches:
                n = rows(x)
                if n == 0:  # every stage of this pipeline has the same (empty) part
                    continue
                size = self._piece or -(-n // self.opts.microbatches)
                xs, ys = _pieces(x, size), _pieces(y, size)
                pieces = []
                for xa, ya, share in zip(xs, ys, self._shares(ys, y)):
                    k = rows(xa)
                    if k < size:
                        xa = map_tensors(lambda t: pad(t, size - k), xa)
                    pieces.append((xa, ya, weight * share))
                actions = sched.forward_only(p, len(pieces), v, rank)
                local += self.engine.forward(actions, pieces, real_rows, precision)
        finally:
            dp_part.free_units(units)
        return local if self.is_last else 0.0

    def memory_report(self, dp_part) -> dict:
        return {**dp_part.memory_report(), "strategy": "pipeline", "pp": self.pp.size,
                "dp": self.dp.size, "dp_sharding": self.flavour}

    # -- checkpoints: every rank describes every tensor of the WHOLE model --
    def _whole(self) -> nn.Module:
        if self._skeleton is None:
            with torch.device("meta"):
                self._skeleton = self.stack.build(range(len(self.stack)))
        return self._skeleton

    def state_entries(self, dp_part) -> list:
        """The flavour's entries of this rank's tensors (placed: the replicas and the stages
        holding a tied copy split the writing), completed to the whole model with empty
        entries for the other stages' tensors."""
        from hpctrain.checkpoint.layout import Entry

        mine = {e.name: e for e in dp_part.state_entries()}
        descr = [[n, list(e.shape), str(e.dtype).replace("torch.", "")] for n, e in mine.items()]
        holders: dict = {}
        for r, per_rank in enumerate(_allgather_json(self.pp, descr)):
            for name, shape, dtype in per_rank:
                holders.setdefault(name, (tuple(shape), getattr(torch, dtype), r))
        out = []
        for name in self._order(holders):
            shape, dtype, _ = holders[name]
            e = mine.get(name)
            out.append(e if e is not None else Entry(name, shape, dtype, None, elems=(0, 0)))
        return out

    def _order(self, names) -> list:
        """The whole model's order: model tensors as its state_dict, then optimizer state
        by parameter, each parameter's keys sorted (the same on every rank)."""
        whole = self._whole()
        model_keys, seen = [], set()
        for key, t in whole.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                model_keys.append(f"model/{key}")
        params = {n: i for i, (n, _) in enumerate(whole.named_parameters())}
        model = [k for k in model_keys if k in names]
        optim = sorted((n for n in names if n.startswith("optim/")),
                       key=lambda n: (params.get(n[6:].rsplit("/", 1)[0], len(params)), n))
        rest = sorted(n for n in names if n not in set(model) and not n.startswith("optim/"))
        return model + optim + rest

    def state_meta(self, dp_part) -> dict:
        whole = self._whole()
        names = [n for n, _ in whole.named_parameters()]
        return dp_part._state_meta(whole, lambda g: names)

    def full_state(self, dp_part) -> dict:
        """The whole model's state: each tensor broadcast over pp from the first stage that
        holds it (collective over the stages and, for sharded units, over dp)."""
        copies = dp_part._gathered()  # sharded units' full values (collective over dp)
        local = {k: (copies[id(t)] if id(t) in copies else t.detach())
                 for k, t in dp_part.model.state_dict(keep_vars=True).items()}
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
                buf = local[next(k for k in keys if k in local)].to(self.pp.device, copy=True)
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, device=self.pp.device)
            self.pp.broadcast(buf, root=src)
            value = buf.cpu()
            out.update({k: value for k in keys})
        return {k: out[k] for k in whole}


def _pieces(b, size: int) -> list:
    """A batch (a tensor or a dict/tuple of them) cut into pieces of ``size`` rows."""
    n = rows(b)
    return [take_rows(b, slice(i, i + size)) for i in range(0, n, size)]


def _first_rows(out, k: int):
    """The first ``k`` rows of a stage's output: a tensor, or the tensors in a Hugging Face
    ModelOutput / dict / tuple (the loss sees the type the model returns)."""
    if isinstance(out, torch.Tensor):
        return out[:k]
    if isinstance(out, dict):  # ModelOutput is an OrderedDict of its set fields
        return type(out)(**{key: _first_rows(v, k) for key, v in out.items()})
    if isinstance(out, (tuple, list)):
        return type(out)(_first_rows(v, k) for v in out)
    return out


def _layer_paths(layer) -> list[str]:
    """Module paths a PipeLayer builds (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        return list(layer.build())


def _module_layers(stack) -> dict:
    """{module path: index of the layer that holds it}: split points may name modules."""
    return {path: i for i, layer in enumerate(stack.layers) for path in _layer_paths(layer)}


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


def _layer_costs(stack, balance: str, probe: Probe, pp, dp):
    """Per-layer cost: parameter count, or forward+backward seconds measured on each pipeline
    rank (one list per rank: the split gives a slower rank fewer layers). All ranks measure
    at once, as they compute in the steady state (one rank timing while the others wait in a
    collective would time it under their polling); replicas over dp keep their slowest time,
    so every rank computes the same split. Given a sample target and the loss, the last layer
    is timed with the loss on its output, since the last stage computes it: a costly loss
    (a large vocabulary's cross-entropy) then leaves that stage fewer layers."""
    if balance == "param-count":
        return [float(c) for c in stack.param_counts()]
    if probe.sample is None:
        raise ValueError("pipeline.balance = 'measured' needs a sample micro-batch")
    costs = torch.zeros(1, len(stack), dtype=torch.float64, device=pp.device)
    x, target, loss_fn = probe.sample, probe.target, probe.loss_fn
    x, side = split_input(stack.inputs, x)
    with_loss = loss_fn is not None and target is not None
    for i, layer in enumerate(stack.layers):
        root = stack.build([i]).to(x.device)
        # A Sequential's layers are the model's own modules: time them without training them.
        before = {k: v.detach().clone() for k, v in root.state_dict().items()}
        times = []
        for _ in range(3):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            out = run_layer(layer, root, inp, side)
            if with_loss and i == len(stack) - 1:
                loss_fn(out, target).backward()
            else:
                _first_tensor(out).float().sum().backward()
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


def _first_tensor(out):
    """The tensor of a layer's output (a dict of one tensor: the last layer's, kept)."""
    return out if isinstance(out, torch.Tensor) else next(iter(out.values()))


def _as_stack(model, sample=None) -> LayerStack:
    """A LayerStack as given; a module split into its chain of layers (ties declared),
    checked against its forward on ``sample`` when given. TypeError for a sample input the
    layers do not take (a dict with keys they do not know)."""
    if isinstance(model, LayerStack):
        if sample is not None:
            check_input(model, sample)
        return model
    if isinstance(model, nn.Module):
        stack = split_model(model, sample)  # TypeError naming what is expected otherwise
        if sample is not None:
            check_input(stack, sample)  # an nn.Sequential's: one tensor
        return stack
    raise TypeError(f"the pipeline strategy takes an nn.Module whose forward is a chain of "
                    f"layers or a models.layers.LayerStack, got {type(model).__name__}")


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
    sub = pp.split(0 if tied_local else None, key=pp.rank, name="pp.tied")
    if not tied_local:
        return None, tied_local
    with torch.no_grad():
        for t in tied_local:
            sub.broadcast(t.detach(), root=0)
            # Each stage's copy gets the gradient of its own uses: summed over the holders
            # at the step, when every stage's schedule is over.
            place(t, placement_of(t).with_copies(Copies("tied", sub, partial=True,
                                                        at_step=True)))
    return sub, tied_local


def prepare(stack, world, options: PipelineOptions | None = None, flavour: str = "ddp",
            probe: Probe | None = None):
    """Build this rank's stage(s) of ``stack`` (a LayerStack, or an nn.Sequential split one
    layer per child) and the schedule; return (stage root module, executor). Collective.
    ``flavour`` is the dp flavour the orchestrator applies next (for the log line);
    ``probe`` what the run's data gives (Probe)."""
    opts = options or PipelineOptions()
    probe = probe or Probe()
    if opts.p2p not in P2P_MODES:  # pure: before any collective
        raise ValueError(f"pipeline.p2p = {opts.p2p!r}: expected one of {', '.join(P2P_MODES)}")
    stack = _as_stack(stack, probe.sample)
    layout = resolve_layout(opts.mesh, world.size)
    p, v = layout.pp, opts.chunks
    plan.check_fits(len(stack), p, v, opts.schedule)       # pure: before any collective
    actions_all = sched.build(opts.schedule, p, opts.microbatches, v)
    ordered = ordered_mode(opts.p2p, world.device, p)
    if ordered:  # NCCL matches by order and blocks sends: prove the order safe first
        p2p_plan.check_ordered(actions_all, v)
    names = [layer.name for layer in stack.layers]
    if opts.split_points:
        starts = plan.split_at(opts.split_points, names, p * v, _module_layers(stack))
    else:
        starts = None
    mesh = world.mesh(layout)
    pp, dp = mesh.comm("pp"), mesh.comm("dp")
    if starts is None:
        starts = plan.balanced_split(_layer_costs(stack, opts.balance, probe, pp, dp), p * v)
    groups = plan.stage_layers(starts, len(stack))
    my_stages = [sched.stage_of(pp.rank, c, p) for c in range(v)]
    owned = [i for g in my_stages for i in groups[g]]
    root = stack.build(owned).to(world.device)
    chunks = [[stack.layers[i] for i in groups[g]] for g in my_stages]
    # One start everywhere, whatever the user's init did (a Sequential built on every rank).
    broadcast_state(root, dp)
    tied_comm, tied_local = _tie_stages(stack, root, pp)
    links = StageLinks(pp, p * v, world.device, ordered)
    engine = Engine(root, chunks, links, pp.rank, p, opts.activation_checkpointing,
                    stack.inputs)
    executor = PipelineExecutor(stack, root, owned, engine, actions_all[pp.rank], pp, dp,
                                tied_comm, tied_local, opts, flavour, probe.unit_count)
    if world.is_main:
        split = " | ".join(f"{g}:{names[grp[0]]}..{names[grp[-1]]}" for g, grp in enumerate(groups))
        print(f"hpctrain: pipeline pp={p} dp={dp.size} schedule={opts.schedule} "
              f"microbatches={opts.microbatches} chunks/rank={v} dp_sharding={flavour} "
              f"p2p={'ordered' if ordered else 'eager'} "
              f"stages {split}", flush=True)
    return root, executor
