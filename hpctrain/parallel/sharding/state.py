"""The sharded engine's checkpoint entries (``ShardState``): sharded tensors as flat element
ranges of the GLOBAL tensors, so a checkpoint of any strategy loads into any other."""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.placement import Copies, entry, placement_of

__all__ = ["ShardState", "read_shard_state"]


class ShardState:
    """ShardedModel's checkpoint state (a mixin: the engine holds ``units``, ``_states``,
    ``name_of``, ``_replicas``, ``_placement`` and ``_refresh``)."""

    def _slot_of(self) -> dict:
        return {id(s.param): (u, s) for u in self.units for s in u.slots}

    def _model_tensors(self):
        """(checkpoint name, tensor) of each distinct model tensor (tied ones once)."""
        seen = set()
        for key, t in self.model.state_dict(keep_vars=True).items():
            if id(t) not in seen:
                seen.add(id(t))
                yield f"model/{self.name_of(key)}", t

    def state_entries(self) -> list:
        """Checkpoint entries named as base.py names them, placed by placement.entry: shards
        give their owned elements of the parameter's slice of the global tensor."""
        slot_of, entries = self._slot_of(), []
        job = self.world.size
        for name, t in self._model_tensors():
            if id(t) in slot_of:
                u, s = slot_of[id(t)]
                elems, view = u.shard_view(s)
                entries.append(entry(name, view, self._placement(s.param), elems, job, s.shape))
            else:
                entries.append(entry(name, t.detach(), self._placement(t), None, job))
        for st in self._states:
            u = st.unit
            state = self.optimizer.state.get(u.shard, {})
            for s in u.slots:
                (a, b), _ = u.shard_view(s)
                start = s.offset + a - u.lo
                placed = self._placement(s.param)
                for k, v in sorted(state.items()):
                    if not torch.is_tensor(v):
                        continue
                    name = f"optim/{self.name_of(s.name)}/{k}"
                    if v.shape == u.shard.shape:
                        entries.append(entry(name, v.detach()[start:start + (b - a)], placed,
                                             (a, b), job, s.shape))
                    else:  # a per-shard scalar such as Adam's step: the same on every rank
                        scalar = placement_of(s.param).scalar(tuple(v.shape)).with_copies(
                            Copies("dp", self.comm), *self._replicas)
                        entries.append(entry(name, v.detach(), scalar, None, job))
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
        from hpctrain.checkpoint.layout import from_numpy

        slot_of = self._slot_of()
        with torch.no_grad():
            for name, t in self._model_tensors():
                if id(t) in slot_of:
                    u, s = slot_of[id(t)]
                    elems, view = u.shard_view(s)
                    placed = placement_of(s.param)
                    a = reader.read(name, placed.global_shape, elems=elems,
                                    box=placed.box(s.shape))
                    if a is not None and view.numel():
                        view.copy_(from_numpy(a, view.dtype).reshape(view.shape))
                else:
                    placed = placement_of(t)
                    a = reader.read(name, placed.global_shape, box=placed.box(tuple(t.shape)))
                    if a is not None:
                        t.detach().copy_(from_numpy(a, t.dtype).reshape(t.shape))
            for u in self.units:
                if not self.plan.on_demand:
                    self._refresh(u)
        if not self._optim_class_matches(reader):
            return
        for u in self.units:
            state = read_shard_state(reader, u, self.name_of)
            if state:
                self.optimizer.state[u.shard] = state
        self._load_param_groups(reader)

    def _gathered(self) -> dict:
        """Each unit's shards all-gathered (collective over the shard group): the masters'
        values, not low-precision compute copies, and never the freed full buffers."""
        gathered = {}
        for u in self.units:
            full = self.comm.allgather(u.shard.detach().to(self.comm.device)).cpu()
            for s in u.slots:
                gathered[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape).clone()
        return gathered

def read_shard_state(reader, u: FlatUnit, name_of=None) -> dict:
    """Optimizer state of unit ``u``'s shard from a checkpoint of global tensors
    (optim/<param>/<key>; ``name_of`` maps a slot's name to the one written): this rank's
    owned elements of each parameter-shaped tensor, per-unit scalars (Adam's step) whole."""
    from hpctrain.checkpoint.layout import from_numpy

    state = {}
    for s in u.slots:
        param = name_of(s.name) if name_of is not None else s.name
        (a, b), _ = u.shard_view(s)
        start = s.offset + a - u.lo
        for k in reader.keys(f"optim/{param}"):
            name = f"optim/{param}/{k}"
            dtype = getattr(torch, reader.dataset(name).attrs["torch_dtype"])
            placed = placement_of(s.param)
            shape = tuple(reader.dataset(name).shape)
            if shape not in ((), tuple(placed.global_shape)):  # another model's: never copied
                reader.fail(f"dataset {name!r} has shape {shape}, parameter {param!r} has "
                            f"{tuple(placed.global_shape)}; resume with the same model")
                continue
            if shape != tuple(placed.global_shape):
                arr = reader.read(name)  # a scalar (Adam's step), kept on the CPU
                if arr is not None:
                    state[k] = from_numpy(np.asarray(arr), dtype).clone()
                continue
            arr = reader.read(name, placed.global_shape, elems=(a, b), box=placed.box(s.shape))
            buf = state.setdefault(k, torch.zeros(u.shard.shape, dtype=dtype,
                                                  device=u.shard.device))
            if arr is not None and b > a:
                buf[start:start + (b - a)].copy_(from_numpy(arr, dtype))
    return state
