"""The pipeline's executor: runs this rank's stage(s) through the schedule, and names the units
the dp flavour shards over each stage's replicas (it never reduces gradients itself)."""

from __future__ import annotations

import json

import torch
from torch import nn

from hpctrain.data.structure import map_tensors, rows, take_rows
from hpctrain.parallel.pipeline import schedule as sched
from hpctrain.parallel.pipeline.engine import Engine
from hpctrain.parallel.pipeline.options import PipelineOptions

__all__ = ["PipelineExecutor", "allgather_json", "layer_paths"]


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
        paths = [[q for layer in chunk for q in layer_paths(layer)] for chunk in chunks]
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
        for r, per_rank in enumerate(allgather_json(self.pp, descr)):
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
        held = [set(keys) for keys in allgather_json(self.pp, sorted(local))]
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


def layer_paths(layer) -> list[str]:
    """Module paths a PipeLayer builds (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        return list(layer.build())


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


def allgather_json(comm, obj) -> list:
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


