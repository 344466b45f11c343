"""ZeRO stages 1, 2 and 3, hand-written over the Communicator (MPI ranks now, NCCL later).

Trainable parameters are flattened per unit (one unit per repeated block plus a root; see
``units.py``) into buffers padded to a multiple of the world size; rank r owns the r-th
slice, and the optimizer steps only those shard parameters.

- stage 1: full gradients on every rank, reduce-scattered (SUM) at the step; after the
  step the updated shards are all-gathered back into the full buffers.
- stage 2: as 1, but on the last micro-batch of a step each unit's gradients are
  reduce-scattered as soon as they are all accumulated, and the full ones freed.
- stage 3: as 2, and the full parameters exist only around a unit's forward and backward.

Gradients are SUMMED (the loop weights each micro-batch by its share of the global batch).
Collectives run in the same order on every rank as long as every rank's autograd graph has
the same structure (the same parameters used), which data parallel training gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from hpctrain.parallel.base import OptimizerFactory, Parallelized
from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.sharded_optim import preserve_elements
from hpctrain.parallel.sync_batchnorm import convert_sync_batchnorm
from hpctrain.parallel.units import partition

__all__ = ["ZeroOptions", "wrap"]


@dataclass(frozen=True)
class ZeroOptions:
    """ZeRO stage (1: optimizer state, 2: + gradients, 3: + parameters sharded), micro-batches
    per step, and whether BatchNorm layers use global-batch statistics."""

    stage: int = 1
    grad_accum: int = 1
    sync_batchnorm: bool = True

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptions.stage = {self.stage!r}: expected 1, 2 or 3 "
                             "(strategies zero1, zero2, zero3)")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"ZeroOptions.grad_accum = {self.grad_accum!r}: expected an int >= 1 "
                             "(the number of backward calls per step)")


class _UnitState:
    """Per-step bookkeeping of one unit's gradients."""

    def __init__(self, unit: FlatUnit):
        self.unit = unit
        self.had = [False] * len(unit.slots)   # got a gradient this step (this rank)
        self.arrived: set = set()              # slots whose grad arrived this micro-batch
        self.flat = None                       # stage 2/3: packed gradients being collected
        self.reduced = False                   # reduce-scattered during the last backward
        self.grad_buf = None                   # stage 1: persistent flat gradient buffer


class Zero(Parallelized):
    """A model whose trainable parameters, gradients and optimizer state are sharded."""

    def __init__(self, model, make_optimizer, world, units, frozen, opts: ZeroOptions):
        self.name = f"zero{opts.stage}"
        self.opts = opts
        self.world = world
        self.comm = world.comm
        self.units = units
        self.frozen = frozen
        self._states = [_UnitState(u) for u in units]
        self._micro = 0
        self._final = True
        self._peak_transient = 0
        self._grad_bytes = 0
        super().__init__(model, make_optimizer([u.shard for u in units]))
        for i, st in enumerate(self._states):
            u = st.unit
            if opts.stage == 1:
                # Autograd accumulates in place into preset .grad views of one flat buffer.
                st.grad_buf = torch.zeros_like(u.full)
                for s in u.slots:
                    s.param.grad = st.grad_buf[s.offset:s.offset + s.numel].view(s.shape)
                u.shard.grad = st.grad_buf[u.lo:u.hi]
            for j, s in enumerate(u.slots):
                s.param.register_post_accumulate_grad_hook(partial(self._on_grad, i, j))

    # ---- backward ----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of loss; on a step's last micro-batch reduce them (stage 2/3)."""
        self._final = self._micro + 1 >= self.opts.grad_accum
        for st in self._states:
            st.arrived = set()
        loss.backward()
        self._micro += 1

    def _on_grad(self, i: int, j: int, param: nn.Parameter) -> None:
        st = self._states[i]
        st.had[j] = True
        if self.opts.stage == 1:
            return
        st.arrived.add(j)
        if self._final:
            self._pack(st, j)
        if len(st.arrived) == len(st.unit.slots):
            if self._final:
                self._reduce(st)
                st.reduced = True
            st.unit.free()  # stage 3: its backward is over (every use of its params is done)

    def _pack(self, st: _UnitState, j: int) -> None:
        """Move slot j's gradient into the unit's flat buffer and free it."""
        u, s = st.unit, st.unit.slots[j]
        if st.flat is None:
            st.flat = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
        st.flat[s.offset:s.offset + s.numel].copy_(s.param.grad.reshape(-1))
        s.param.grad = None
        self._peak_transient = max(self._peak_transient, st.flat.numel() * st.flat.element_size())

    def _reduce(self, st: _UnitState) -> None:
        """Reduce-scatter the unit's flat gradient (SUM) into its shard gradient (collective)."""
        u = st.unit
        flat = st.flat if st.flat is not None else u.flat_grad()
        part = self.comm.reduce_scatter(flat, op="sum")
        st.flat = None
        if u.shard.grad is None:
            u.shard.grad = part
        else:
            u.shard.grad.add_(part)

    def _sync_grads(self) -> None:
        # Reduce what the hooks did not: stage 1 always, stage 2/3 units with a parameter
        # that got no gradient in the last backward (or leftovers of earlier micro-batches).
        # Whether a hook reduced a unit is the same on every rank: it was a collective.
        for st in self._states:
            u = st.unit
            if self.opts.stage == 1:
                for s in u.slots:  # someone called zero_grad(): point .grad back at the buffer
                    view = st.grad_buf[s.offset:s.offset + s.numel]
                    g = s.param.grad
                    if g is None:
                        view.zero_()
                    elif g.data_ptr() != view.data_ptr():
                        view.copy_(g.reshape(-1))
                    s.param.grad = view.view(s.shape)
                tmp = self.comm.reduce_scatter(st.grad_buf, op="sum")
                st.grad_buf[u.lo:u.hi].copy_(tmp)
                continue
            if not st.reduced:
                for j, s in enumerate(u.slots):
                    if s.param.grad is not None:
                        self._pack(st, j)
                self._reduce(st)
            st.reduced = False
            u.free()
            if u.shard.grad is None:
                u.shard.grad = torch.zeros_like(u.shard)

    # ---- the step ----------------------------------------------------------------------

    def _untouched(self) -> dict:
        """{shard: shard-local ranges} of parameters that got no gradient on ANY rank."""
        had = torch.tensor([h for st in self._states for h in st.had], dtype=torch.uint8)
        if len(had):
            self.world.host.allreduce(had, op="max")
        flags, out, k = had.tolist(), {}, 0
        for st in self._states:
            n = len(st.unit.slots)
            idle = [s for s, f in zip(st.unit.slots, flags[k:k + n]) if not f]
            out[st.unit.shard] = st.unit.owned_ranges(idle)
            k += n
        return out

    def _agree_on_inf(self, scaler) -> None:
        # Each rank unscaled only its shard; an inf in another rank's shard must skip the
        # step here too. (GradScaler keeps found_inf per optimizer in this private table.)
        found = scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        for t in found.values():
            self.comm.allreduce(t, op="max")

    def _grad_norm(self) -> float:
        sq = sum(float(u.shard.grad.detach().double().pow(2).sum()) for u in self.units
                 if u.shard.grad is not None)
        return math.sqrt(self.world.host.allreduce_scalars([sq])[0])

    def _clip(self, max_norm: float) -> float:
        norm = self._grad_norm()
        if math.isfinite(norm) and norm > max_norm:
            for u in self.units:
                if u.shard.grad is not None:
                    u.shard.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def step(self, scaler=None, max_grad_norm: float = 0.0) -> None:
        """Reduce-scatter gradients, unscale/clip over shards, step the shards, re-gather."""
        self._sync_grads()
        untouched = self._untouched()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
            self._agree_on_inf(scaler)
        if max_grad_norm > 0:
            self._clip(max_grad_norm)
        with preserve_elements(self.optimizer, untouched):
            self._optimizer_step(scaler)
        # Measured, not assumed: every gradient tensor alive at the step.
        self._grad_bytes = _nbytes([u.shard.grad for u in self.units if u.shard.grad is not None]
                                   + [st.grad_buf for st in self._states if st.grad_buf is not None]
                                   + [s.param.grad for u in self.units for s in u.slots
                                      if s.param.grad is not None])
        for st in self._states:
            if self.opts.stage == 1:
                st.grad_buf.zero_()
            else:
                st.unit.shard.grad = None
            st.had = [False] * len(st.unit.slots)
            if self.opts.stage < 3:
                st.unit.gather()  # params are views of the full buffer: the model sees the step
        self._micro = 0

    # ---- checkpoints: sharded tensors as flat element ranges of the GLOBAL tensors -----

    def _slot_of(self) -> dict:
        return {id(s.param): (u, s) for u in self.units for s in u.slots}

    def state_entries(self) -> list:
        """Checkpoint entries named as base.py names them; shards give their owned elements."""
        from hpctrain.checkpoint.layout import Entry

        slot_of, entries, seen = self._slot_of(), [], set()
        for key, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) in slot_of:
                u, s = slot_of[id(t)]
                elems, view = u.shard_view(s)
                entries.append(Entry(f"model/{key}", s.shape, t.dtype, view, elems=elems))
            else:
                entries.append(Entry(f"model/{key}", tuple(t.shape), t.dtype, t.detach()))
        for u in self.units:
            state = self.optimizer.state.get(u.shard, {})
            for s in u.slots:
                (a, b), _ = u.shard_view(s)
                start = s.offset + a - u.lo
                for k, v in sorted(state.items()):
                    if not torch.is_tensor(v):
                        continue
                    name = f"optim/{s.name}/{k}"
                    if v.shape == u.shard.shape:
                        entries.append(Entry(name, s.shape, v.dtype,
                                             v.detach()[start:start + (b - a)], elems=(a, b)))
                    else:  # a per-shard scalar such as Adam's step: the same on every rank
                        entries.append(Entry(name, tuple(v.shape), v.dtype, v.detach()))
        return entries

    def state_meta(self) -> dict:
        """As base.py, with the parameter names behind the flat shards in the groups."""
        meta = super().state_meta()
        names = [s.name for u in self.units for s in u.slots]
        for g in meta["optim_param_groups"]:
            g["params"] = names
        return meta

    def load_state_entries(self, reader) -> None:
        """Load this rank's shards and replicated tensors from a checkpoint of any strategy."""
        import json

        from hpctrain.checkpoint.layout import from_numpy

        with torch.no_grad():
            for e in self.state_entries():
                if not e.name.startswith("model/"):
                    continue
                a = reader.read(e.name, e.shape, elems=e.elems)
                if a is not None and e.local.numel():
                    e.local.copy_(from_numpy(a, e.dtype).reshape(e.local.shape))
            for u in self.units:
                if self.opts.stage < 3:
                    u.gather()
        saved = json.loads(reader.attrs.get("optim_class", '""'))
        if saved != self._optim_class():
            reader.fail(f"optimizer is {self._optim_class()} but the checkpoint holds {saved} "
                        f"state; resume with --optimizer matching the checkpoint")
            return
        for u in self.units:
            state = {}
            for s in u.slots:
                (a, b), _ = u.shard_view(s)
                start = s.offset + a - u.lo
                for k in reader.keys(f"optim/{s.name}"):
                    name = f"optim/{s.name}/{k}"
                    dtype = getattr(torch, reader.dataset(name).attrs["torch_dtype"])
                    if tuple(reader.dataset(name).shape) != tuple(s.shape):
                        arr = reader.read(name)  # a scalar (Adam's step), kept on the CPU
                        if arr is not None:
                            state[k] = from_numpy(np.asarray(arr), dtype).clone()
                        continue
                    arr = reader.read(name, s.shape, elems=(a, b))
                    buf = state.setdefault(k, torch.zeros(u.shard.shape, dtype=dtype,
                                                          device=u.shard.device))
                    if arr is not None and b > a:
                        buf[start:start + (b - a)].copy_(from_numpy(arr, dtype))
            if state:
                self.optimizer.state[u.shard] = state
        self._load_param_groups(reader)

    # ---- norms and memory --------------------------------------------------------------

    def param_norm(self) -> float:
        """Global L2 norm of all parameters: shards summed over ranks, frozen ones once."""
        with torch.no_grad():
            sq = sum(float(u.shard.detach().double().pow(2).sum()) for u in self.units)
            sq = self.world.host.allreduce_scalars([sq])[0]
            sq += sum(float(p.detach().double().pow(2).sum()) for _, p in self.frozen)
        return math.sqrt(sq)

    def memory_report(self) -> dict:
        """Bytes this rank holds for trainable params and optimizer state, the gradients alive
        at the last step, the largest transient buffers (a gathered unit, a gradient bucket)
        and the frozen (replicated) params."""
        params = _nbytes([u.full for u in self.units if self.opts.stage < 3] +
                        [u.shard for u in self.units])
        grads = self._grad_bytes
        optim = _nbytes([v for st in self.optimizer.state.values() for v in st.values()
                        if torch.is_tensor(v)])
        gathered = max(u.full_bytes() for u in self.units) if self.opts.stage == 3 else 0
        return {"stage": self.opts.stage, "world_size": self.comm.size,
                "trainable_numel": sum(u.numel for u in self.units),
                "padded_numel": sum(u.padded for u in self.units),
                "params": params, "grads": grads, "optimizer": optim,
                "largest_gathered_unit": gathered,
                "transient_grad_bucket": self._peak_transient,
                "frozen_params": _nbytes([p for _, p in self.frozen])}


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _broadcast_state(model: nn.Module, comm) -> None:
    """Parameters and buffers from rank 0, so a model with random init agrees everywhere."""
    seen = set()
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if id(t) not in seen and t.numel():
                seen.add(id(t))
                comm.broadcast(t.detach(), root=0)


def _install_gather_hooks(model: nn.Module, specs, units) -> None:
    """Stage 3: gather a unit before its forward and its backward, free it after forward."""
    def regather(unit, grad):
        unit.gather()

    def after_forward(unit, module, args, output):
        if torch.is_grad_enabled():
            stack = [output]
            while stack:
                o = stack.pop()
                if isinstance(o, torch.Tensor):
                    if o.requires_grad:
                        o.register_hook(partial(regather, unit))
                elif isinstance(o, (list, tuple)):
                    stack.extend(o)
                elif isinstance(o, dict):
                    stack.extend(o.values())
        unit.free()

    for spec, unit in zip(specs, units):
        spec.module.register_forward_pre_hook(lambda m, args, u=unit: u.gather())
        spec.module.register_forward_hook(partial(after_forward, unit))
        unit.free()


def wrap(model: nn.Module, make_optimizer: OptimizerFactory, world, options: ZeroOptions | None = None
         ) -> Parallelized:
    """Shard model and optimizer over all ranks with ZeRO (collective over the world)."""
    opts = options or ZeroOptions()
    model.to(world.device)
    if opts.sync_batchnorm:  # batch statistics of the global batch, as in one process
        model = convert_sync_batchnorm(model, world.comm)
    _broadcast_state(model, world.comm)
    specs, frozen = partition(model)
    units = [FlatUnit(s.name, s.params, world.comm, keep_full=opts.stage < 3) for s in specs]
    if opts.stage == 3:
        _install_gather_hooks(model, specs, units)
    return Zero(model, make_optimizer, world, units, frozen, opts)
