"""What every strategy's wrap() returns: a model to call and a step to take."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np

import torch
from torch import nn

from hpctrain.data.structure import call_model, rows
from hpctrain.parallel.storage import nbytes
from hpctrain.runtime.abort import set_context

__all__ = ["OptimizerFactory", "Parallelized", "DPGroups"]

# Strategies build the optimizer themselves (sharded ones over their local shard only).
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class DPGroups:
    """The communicators a data-parallel flavour works over, given by the orchestrator.

    ``dp``: the replicas that split the batch (gradients summed, state sharded over them);
    ``partial``: groups whose ranks hold PARTIAL gradients of the same parameters (the tiles
    of a domain split), summed over too. ``batch``: the ranks holding the same parameters
    and together the global batch (start values broadcast, BatchNorm statistics): dp times
    the partial groups. Which group sums which parameter's gradient, and how each counts in
    norms and checkpoints, is the parameters' placements (placement.py).
    """

    def __init__(self, dp, partial=(), batch=None):
        self.dp = dp
        self.partial = tuple(c for c in partial if c.size > 1)
        self.batch = batch if batch is not None else dp

    @classmethod
    def of_world(cls, world) -> "DPGroups":
        """Every rank a dp replica (a one-dimensional plan)."""
        return cls(world.comm, (), world.comm)

    @property
    def sum_size(self) -> int:
        """How many ranks a gradient is summed over."""
        n = self.dp.size
        for c in self.partial:
            n *= c.size
        return n


class Parallelized:
    """A model wrapped by a strategy, with its optimizer.

    The training loop calls ``model(x)``, ``backward(loss)`` once per micro-batch and
    ``step()`` once per optimizer step. Subclasses override the ``_sync_grads`` hook (make
    gradients final) and ``_grad_norm``/``param_norm`` where state is sharded.

    Which calls are collective is the same under every strategy, so code written against one
    strategy runs under another. Collective (every rank calls it, in the same order):
    ``model(x)`` and its backward (zero3/fsdp gather units, domain exchanges halos,
    synchronized BatchNorm reduces statistics), ``backward``, ``forward_backward``, ``step``,
    ``param_norm``, ``buffer_norm``, ``full_state_dict`` and the checkpoint hooks
    ``state_entries`` and ``load_state_entries`` (the checkpoint package calls them on every
    rank). Local (any rank alone): ``data_shard``, ``load_batch``, ``memory_report``,
    ``state_meta``.
    """

    name = "base"
    # The data-parallel replicas of every tensor (placement.Copies), set by the flavour.
    dp_copies: tuple = ()

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, job_comm=None):
        self.model = model
        self.optimizer = optimizer
        self.job_comm = job_comm  # host Communicator over every rank of the job (None: one)

    def _placement(self, t: torch.Tensor):
        """Where t lives: its model-parallel placement, held alike by the dp replicas."""
        from hpctrain.parallel.placement import placement_of

        return placement_of(t).with_copies(*self.dp_copies)

    def placements(self) -> dict:
        """{parameter name: its Placement} for this rank's parameters (local)."""
        return {name: self._placement(p) for name, p in self.model.named_parameters()}

    def _norm(self, tensors) -> float:
        """Global L2 norm of tensors, each element once however placed; collective."""
        from hpctrain.parallel.placement import global_norm

        with torch.no_grad():
            return global_norm([(t, self._placement(t).norm_weight) for t in tensors],
                               self.job_comm)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss (already weighted by its share of the global batch).
        Collective: sharded strategies reduce gradients during backward, ddp starts its
        all-reduces."""
        loss.backward()

    def data_shard(self, world) -> tuple[int, int]:
        """(index, count) of this rank's share of each micro-batch (local). Ranks that need the
        same samples (the stages of one pipeline) return the same index."""
        return world.rank, world.size

    def forward_backward(self, micro_batches: Iterable, loss_fn, precision) -> float:
        """Run forward and backward over one step's micro-batches; return the weighted loss.

        ``micro_batches`` yields ``(x, y, weight)`` with weight = the micro-batch's share of
        the global batch. Strategies that schedule micro-batches themselves (pipeline) or
        split each sample (domain) override this; the loop never looks inside. Collective.
        """
        local = 0.0
        for x, y, weight in micro_batches:
            set_context(phase="forward")  # named in flight records and stall reports
            with precision.autocast():
                loss = loss_fn(call_model(self.model, x), y)
            set_context(phase="backward")
            self.backward(precision.scale(loss * weight))
            local += float(loss.detach()) * weight
        return local

    def forward_loss(self, micro_batches: Iterable, loss_fn, precision) -> float:
        """``forward_backward`` without the backward (evaluation): sum of weight x loss over
        ``micro_batches``, under no_grad, in the model's current mode. An empty micro-batch
        is forwarded too (sharded strategies gather with the other ranks) but adds no loss.
        Collective."""
        local = 0.0
        with torch.no_grad():
            for x, y, weight in micro_batches:
                with precision.autocast():
                    out = call_model(self.model, x)
                    if rows(x):
                        local += float(loss_fn(out, y)) * weight
        return local

    def load_batch(self, dataset, indices):
        """Collate this rank's samples (domain parallel reads only its tile of each); local."""
        from hpctrain.data.sampler import collate

        return collate(dataset, indices)

    def _sync_grads(self) -> None:
        """Make every gradient the global one (no-op for one process)."""

    def _grad_norm(self) -> float:
        from hpctrain.parallel.placement import global_norm

        return global_norm([(p.grad, self._norm_weight(p))
                            for p in self.model.parameters() if p.grad is not None],
                           self.job_comm)

    def _norm_weight(self, t: torch.Tensor) -> float:
        """``self._placement(t).norm_weight``, without building Placements when _placement
        is this class's: the grad norm runs it for every parameter each step, host time a
        GPU waits through (about 10 us a parameter)."""
        if type(self)._placement is not Parallelized._placement:
            return self._placement(t).norm_weight
        from hpctrain.parallel.placement import n_copies_of

        n = n_copies_of(t)
        for c in self.dp_copies:
            n *= c.size
        return 1.0 / n

    def _clip(self, max_norm: float) -> float:
        norm = self._grad_norm()
        if math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm

    def _optimizer_step(self, scaler) -> None:
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()

    def step(self, scaler=None, max_grad_norm: float = 0.0, guard=None) -> bool:
        """Finish the gradients, unscale/clip them, step the optimizer and zero the gradients
        (collective). ``guard`` (train/nonfinite.py) may skip the optimizer step or stop;
        returns whether the optimizer stepped."""
        self._sync_grads()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        norm = self._clip(max_grad_norm) if max_grad_norm > 0 else None
        stepped = guard is None or guard.check(self, scaler, norm)
        if stepped:
            self._optimizer_step(scaler)
        elif scaler is not None:
            scaler.update()  # the step is dropped; the scaler is ready for the next one
        self.optimizer.zero_grad()  # torch >= 2.0 sets grads to None (Horovod takes no args)
        return stepped

    def _nonfinite_grads(self) -> tuple[list, list]:
        """(this rank's parameter names in model order, those whose gradient holds a NaN or
        inf); local, the non-finite guard's failure path."""
        named = list(self.model.named_parameters())
        return [n for n, _ in named], [n for n, p in named if p.grad is not None
                                       and not bool(torch.isfinite(p.grad).all())]

    # -- checkpoint hooks: describe tensors GLOBALLY; the checkpoint package does the I/O --

    def _optim_class(self) -> str:
        # Horovod wraps the optimizer in a dynamic subclass; name the torch class.
        return next(c.__name__ for c in type(self.optimizer).__mro__
                    if c.__module__.startswith("torch.optim"))

    def _job_size(self) -> int:
        return self.job_comm.size if self.job_comm is not None else 1

    def state_entries(self) -> list:
        """Checkpoint entries of model and optimizer state, placed (placement.entry): the
        global tensor, this rank's slice of it, the replicas splitting the writing.

        Model tensors are keyed by state_dict key (tied ones once), optimizer state by
        PARAMETER NAME, so a checkpoint loads under any strategy. Sharded strategies override
        this to give their flat shards.
        """
        from hpctrain.parallel.placement import entry

        entries, seen, job = [], set(), self._job_size()
        for key, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                entries.append(entry(f"model/{key}", t.detach(), self._placement(t), None, job))
        for name, p in self.model.named_parameters():
            placed = self._placement(p)
            for k, v in sorted(self.optimizer.state.get(p, {}).items()):
                if torch.is_tensor(v):
                    # a scalar such as Adam's step goes with the whole tensor
                    placed_v = placed.scalar(tuple(v.shape)) if v.shape != p.shape else placed
                    entries.append(entry(f"optim/{name}/{k}", v.detach(), placed_v, None, job))
        return entries

    def state_meta(self) -> dict:
        """JSON-able facts the loader needs: tied-key aliases, optimizer class and groups."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return self._state_meta(self.model, lambda g: [names[id(p)] for p in g["params"]
                                                       if id(p) in names])

    def _state_meta(self, module: nn.Module, group_param_names) -> dict:
        """state_meta of `module` (the whole model); group_param_names(group) -> names."""
        first, aliases = {}, {}
        for key, t in module.state_dict(keep_vars=True).items():
            aliases.update({key: first[id(t)]} if id(t) in first else {})
            first.setdefault(id(t), key)
        groups = [{**{k: v for k, v in g.items() if k != "params" and _jsonable(v)},
                   "params": group_param_names(g)} for g in self.optimizer.param_groups]
        return {"model_aliases": aliases, "optim_class": self._optim_class(),
                "optim_param_groups": groups}

    def load_state_entries(self, reader) -> None:
        """Load model and optimizer state from a checkpoint reader (errors collected by it)."""
        from hpctrain.checkpoint.layout import from_numpy

        seen = set()
        with torch.no_grad():
            for key, t in self.model.state_dict(keep_vars=True).items():
                if id(t) in seen:
                    continue
                seen.add(id(t))
                placed = self._placement(t)
                a = reader.read(f"model/{key}", placed.global_shape,
                                box=placed.box(tuple(t.shape)))
                if a is not None:
                    t.detach().copy_(from_numpy(a, t.dtype).reshape(t.shape))
        self._load_optimizer_state(reader, self.model.named_parameters())

    def _optim_class_matches(self, reader) -> bool:
        """False (and the reader told why) if the checkpoint holds another optimizer's state."""
        import json

        saved = json.loads(reader.attrs.get("optim_class", '""'))
        if saved != self._optim_class():
            reader.fail(f"optimizer is {self._optim_class()} but the checkpoint holds {saved} "
                        f"state; resume with --optimizer matching the checkpoint")
            return False
        return True

    def _load_optimizer_state(self, reader, named_params) -> None:
        """Load per-parameter optimizer state (``optim/<name>/<key>``) and the param groups;
        ``named_params`` yields (name in the checkpoint, local parameter)."""
        from hpctrain.checkpoint.layout import from_numpy

        if not self._optim_class_matches(reader):
            return
        for name, p in named_params:
            group = f"optim/{name}"
            placed = self._placement(p)
            state = {}
            for k in reader.keys(group):
                shape = tuple(reader.dataset(f"{group}/{k}").shape)
                if shape not in ((), tuple(placed.global_shape)):
                    reader.fail(f"dataset {group + '/' + k!r} has shape {shape}, parameter "
                                f"{name!r} has {tuple(placed.global_shape)}; resume with the "
                                f"same model")
                    continue
                a = reader.read(f"{group}/{k}", box=placed.box(tuple(p.shape)) if shape else None)
                if a is None:
                    continue
                dtype = getattr(torch, reader.dataset(f"{group}/{k}").attrs["torch_dtype"])
                t = from_numpy(np.asarray(a), dtype)
                # Scalars (Adam's step) stay on the CPU, as torch keeps them.
                state[k] = t.clone() if t.dim() == 0 else t.to(p.device).clone()
            if state:
                self.optimizer.state[p] = state
        self._load_param_groups(reader)

    def _load_param_groups(self, reader) -> None:
        """Restore the optimizer's param-group hyperparameters saved by state_meta()."""
        import json

        from hpctrain.checkpoint.meta import param_group_problems

        groups = json.loads(reader.attrs.get("optim_param_groups", "[]"))
        wrong = param_group_problems(groups, self.optimizer.param_groups, self._optim_class())
        if wrong:  # applied, it would fail in the middle of a step
            reader.fail(f"{wrong[0]}; the file was changed after it was written: resume from "
                        f"an older checkpoint")
            return
        for g, sg in zip(self.optimizer.param_groups, groups):
            g.update({k: (tuple(v) if isinstance(g.get(k), tuple) else v)
                      for k, v in sg.items() if k != "params" and k in g})

    def buffer_norm(self) -> float:
        """Global L2 norm of the floating-point buffers (e.g. BatchNorm running statistics);
        collective."""
        return self._norm([b for b in self.model.buffers() if b.is_floating_point()])

    def param_norm(self) -> float:
        """Global L2 norm of all parameters (each shared parameter counted once); collective."""
        return self._norm(list(self.model.parameters()))

    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """The whole model's state_dict, as one process would have it: CPU copies, shards
        gathered, pipeline stages collected (tied parameters: one tensor under each key).
        Collective: every rank calls it; with ``rank0_only`` the others return {}."""
        state = self._full_state()
        if self.job_comm is not None:
            self.job_comm.barrier()  # collective under every strategy, as the sharded ones are
        if rank0_only and self.job_comm is not None and self.job_comm.rank != 0:
            return {}
        return state

    def _full_state(self) -> dict:
        """The whole model's state on this rank: the local model's, with the full values of
        parameters this rank does not hold whole (``_gathered``)."""
        copies = self._gathered()
        return {k: _cpu_copy(t, copies) for k, t in self.model.state_dict(keep_vars=True).items()}

    def _gathered(self) -> dict:
        """{id(parameter): its full CPU value} for parameters sharded over ranks (none here)."""
        return {}

    def memory_report(self) -> dict:
        """Bytes this rank holds for parameters, gradients (now) and optimizer state (the
        replicated flavours hold everything whole); local."""
        return {"strategy": self.name, "params": nbytes(list(self.model.parameters())),
                "grads": nbytes([p.grad for p in self.model.parameters() if p.grad is not None]),
                "optimizer": nbytes([v for st in self.optimizer.state.values()
                                     for v in st.values() if torch.is_tensor(v)])}


def _cpu_copy(t: torch.Tensor, copies: dict) -> torch.Tensor:
    """A detached CPU copy of t, the same one for every key of a tied tensor."""
    if id(t) not in copies:
        copies[id(t)] = t.detach().to("cpu", copy=True)
    return copies[id(t)]


def _jsonable(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v))
