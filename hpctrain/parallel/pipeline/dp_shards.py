"""ZeRO-1 / ZeRO-2 over the dp replicas of each pipeline stage (pipeline.dp_sharding).

The replicas of one stage hold the same layers, so their trainable parameters are flattened
into FlatUnits over the dp communicator: one unit per set of local chunks that use the
parameters (usually one per chunk) and one per tied copy (GPT's embedding on the first and
last stage), so a tied copy's shard covers the same elements on both stages. The optimizer
steps only this rank's shards (its state is 1/dp of the stage's); after the step the shards
are all-gathered back into the full buffers the layers compute with.

- zero1: autograd accumulates the micro-batches' gradients into one flat buffer per unit,
  reduce-scattered (SUM) over dp at the step.
- zero2: in a step's last schedule run, a unit's gradients are reduce-scattered piece by
  piece right after the rank's last backward of the chunks that use it, and the full
  gradients freed: between steps only the 1/dp gradient shards live.

Tied copies' shard gradients are then summed over the stages holding them; norms sum shards
over dp and stages over pp, tied copies counted once (on the owner's stage).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

from hpctrain.parallel.flat_buffer import FlatUnit
from hpctrain.parallel.sharded_optim import preserve_elements
from hpctrain.parallel.sharding.engine import nbytes, read_shard_state, reduce_scatter_grads

__all__ = ["DP_SHARDINGS", "DPShards"]

DP_SHARDINGS = ("ddp", "zero1", "zero2")


def _layer_paths(layer) -> list[str]:
    """Module paths a PipeLayer builds (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        return list(layer.build())


class _Unit:
    """A FlatUnit with its step bookkeeping."""

    def __init__(self, unit: FlatUnit, trigger: int | None, counted: bool, tied: bool):
        self.unit = unit
        self.trigger = trigger          # action index of the last backward that uses it
        self.counted = counted          # in norms (a tied alias copy is not)
        self.tied = tied
        self.had = [False] * len(unit.slots)
        self.reduced = False
        self.grad_buf = None            # zero1: the flat gradient buffer


class DPShards:
    """The sharded parameters, gradients and optimizer of one pipeline rank's stage(s)."""

    def __init__(self, root, chunks, actions, tied_names: dict, dp, pp, tied_comm, tied_local,
                 mode: str, make_optimizer):
        if mode not in ("zero1", "zero2"):
            raise ValueError(f"pipeline.dp_sharding = {mode!r}: expected one of {DP_SHARDINGS}")
        self.mode, self.dp, self.pp, self.tied_comm = mode, dp, pp, tied_comm
        self.final = True
        self._grad_bytes = 0
        self._peak_transient = 0
        paths = [[q for layer in chunk for q in _layer_paths(layer)] for chunk in chunks]
        uses: dict[int, set] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            for c, qs in enumerate(paths):
                if any(name == q or name.startswith(q + ".") for q in qs):
                    uses.setdefault(id(p), set()).add(c)
        last_b = {}
        for i, a in enumerate(actions):
            if a.op == "B":
                last_b[a.chunk] = i
        tied_ids = [id(p) for p in tied_local]
        groups: dict[tuple, list] = {}
        self.frozen = []
        for name, p in root.named_parameters():
            if not p.requires_grad:
                self.frozen.append((name, p))
            elif id(p) not in tied_ids:
                groups.setdefault(tuple(sorted(uses.get(id(p), ()))), []).append((name, p))
        # Tied copies last, in the stack's tied order: the same order on every stage holding one.
        specs = [(f"chunks{list(k)}", k, ps, False) for k, ps in groups.items()]
        names = {id(p): n for n, p in root.named_parameters()}
        specs += [(f"tied:{names[i]}", tuple(sorted(uses.get(i, ()))),
                   [(names[i], p)], True) for i, p in zip(tied_ids, tied_local)]
        self.units: list[_Unit] = []
        for label, used, params, tied in specs:
            fu = FlatUnit(label, params, dp, keep_full=True)
            trigger = max((last_b[c] for c in used if c in last_b), default=None)
            counted = not any(s.name in tied_names for s in fu.slots)
            self.units.append(_Unit(fu, trigger, counted, tied))
        for i, st in enumerate(self.units):
            u = st.unit
            if mode == "zero1":  # autograd accumulates in place into views of one buffer
                st.grad_buf = torch.zeros_like(u.full)
                u.point_grads(st.grad_buf)
            for j, s in enumerate(u.slots):
                s.param.register_post_accumulate_grad_hook(partial(self._on_grad, i, j))
        self.optimizer = make_optimizer([st.unit.shard for st in self.units])
        self._slot_by_name = {s.name: (st.unit, s) for st in self.units for s in st.unit.slots}

    # ---- gradients -----------------------------------------------------------------------

    def _on_grad(self, i: int, j: int, param) -> None:
        self.units[i].had[j] = True

    def begin_run(self, final: bool) -> None:
        """The next schedule run is (final) or is not the step's last: only the last reduces."""
        self.final = final

    def after_backward(self, index: int) -> None:
        """Called by the engine after action ``index`` (a backward) of a schedule run."""
        if self.mode != "zero2" or not self.final:
            return
        for st in self.units:
            if st.trigger == index and not st.reduced:
                self._reduce(st)
                st.reduced = True

    def _reduce(self, st: _Unit) -> None:
        """Reduce-scatter the unit's gradients (SUM over dp) into its shard gradient, piece by
        piece straight from the params' grads (no unit-sized packed copy), then free them."""
        u = st.unit
        part, transient = reduce_scatter_grads(u, self.dp)
        self._peak_transient = max(self._peak_transient, transient)
        u.add_shard_grad(part)

    def _sync(self) -> None:
        """Make every shard gradient final: reduce what is left over dp, sum tied copies."""
        for st in self.units:
            u = st.unit
            if self.mode == "zero1":
                u.reduce_grad_buffer(st.grad_buf, self.dp)
            else:
                if not st.reduced:
                    self._reduce(st)
                st.reduced = False
        if self.tied_comm is not None:
            for st in self.units:
                if st.tied:
                    self.tied_comm.allreduce(st.unit.shard.grad)

    def _untouched(self) -> dict:
        """{shard: shard-local ranges} of parameters that got no gradient on any replica (and,
        for tied copies, on no stage holding one): the optimizer must not move them."""
        had = torch.tensor([float(h) for st in self.units for h in st.had],
                           dtype=torch.float32, device=self.dp.device)
        if len(had) and self.dp.size > 1:
            self.dp.allreduce(had, op="max")
        tied = [k for k, st in enumerate(self.units) if st.tied]
        if tied and self.tied_comm is not None:
            starts = np.cumsum([0] + [len(st.had) for st in self.units])
            idx = torch.tensor([int(starts[k]) for k in tied], device=had.device)
            sub = had[idx].clone()  # one slot per tied unit
            self.tied_comm.allreduce(sub, op="max")
            had[idx] = sub
        flags, out, k = had.tolist(), {}, 0
        for st in self.units:
            n = len(st.unit.slots)
            idle = [s for s, f in zip(st.unit.slots, flags[k:k + n]) if not f]
            out[st.unit.shard] = st.unit.owned_ranges(idle)
            k += n
        return out

    def grad_norm(self) -> float:
        sq = sum(float(st.unit.shard.grad.detach().double().pow(2).sum()) for st in self.units
                 if st.counted and st.unit.shard.grad is not None)
        if self.dp.size > 1:
            sq = self.dp.allreduce_scalars([sq])[0]
        if self.pp.size > 1:
            sq = self.pp.allreduce_scalars([sq])[0]
        return math.sqrt(sq)

    # ---- the step ------------------------------------------------------------------------

    def step(self, scaler=None, max_grad_norm: float = 0.0) -> None:
        if scaler is not None:  # config refuses fp16 for the pipeline; no silent wrong step
            raise ValueError("pipeline.dp_sharding zero1/zero2 does not support fp16 loss "
                             "scaling; use bf16 or fp32")
        self._sync()
        untouched = self._untouched()
        if max_grad_norm > 0:
            norm = self.grad_norm()
            if math.isfinite(norm) and norm > max_grad_norm:
                for st in self.units:
                    if st.unit.shard.grad is not None:
                        st.unit.shard.grad.mul_(max_grad_norm / (norm + 1e-6))
        with preserve_elements(self.optimizer, untouched):
            self.optimizer.step()
        # Measured, not assumed: every gradient tensor alive at the step.
        self._grad_bytes = nbytes([st.unit.shard.grad for st in self.units
                                   if st.unit.shard.grad is not None]
                                  + [st.grad_buf for st in self.units if st.grad_buf is not None]
                                  + [s.param.grad for st in self.units for s in st.unit.slots
                                     if s.param.grad is not None])
        for st in self.units:
            if self.mode == "zero1":
                st.grad_buf.zero_()
            else:
                st.unit.shard.grad = None
            st.had = [False] * len(st.had)
            if self.dp.size > 1:
                st.unit.gather()  # the layers' params are views of the full buffer

    # ---- checkpoints: optimizer state as owned element ranges of the GLOBAL tensors -------

    def local_optim_descr(self, canonical: set) -> list:
        """[param name, key, global shape, dtype] of the optimizer tensors this rank holds."""
        out = []
        for st in self.units:
            u = st.unit
            state = self.optimizer.state.get(u.shard, {})
            for s in u.slots:
                if s.name not in canonical:
                    continue
                for k, v in sorted(state.items()):
                    if torch.is_tensor(v):
                        shape = s.shape if v.shape == u.shard.shape else tuple(v.shape)
                        out.append([s.name, k, list(shape), str(v.dtype).replace("torch.", "")])
        return out

    def optim_entry(self, name: str, key: str, shape: tuple, dtype, canonical: set):
        """The Entry of optim/name/key: this rank's owned elements of a shard-shaped state
        tensor; a per-unit scalar (Adam's step) written by dp rank 0."""
        from hpctrain.checkpoint.layout import Entry, numel

        ds = f"optim/{name}/{key}"
        found = self._slot_by_name.get(name) if name in canonical else None
        v = None
        if found is not None:
            u, s = found
            v = self.optimizer.state.get(u.shard, {}).get(key)
        if v is None:
            return Entry(ds, shape, dtype, None, elems=(0, 0))
        if v.shape == u.shard.shape:
            (a, b), _ = u.shard_view(s)
            start = s.offset + a - u.lo
            return Entry(ds, shape, dtype, v.detach()[start:start + (b - a)], elems=(a, b))
        n = numel(shape) if self.dp.rank == 0 else 0
        return Entry(ds, shape, dtype, v.detach().reshape(-1)[:n], elems=(0, n))

    def load_optimizer(self, reader, tied: dict) -> None:
        """This rank's shards of the optimizer state, from a checkpoint of any strategy; a tied
        copy reads its owner's state."""
        for st in self.units:
            state = read_shard_state(reader, st.unit, lambda name: tied.get(name, name))
            if state:
                self.optimizer.state[st.unit.shard] = state

    # ---- memory ----------------------------------------------------------------------------

    def memory_report(self) -> dict:
        """Bytes this rank holds: full params (the layers compute with them), the gradients
        alive at the last step, the optimizer state (of the shards only)."""
        optim = nbytes([v for s in self.optimizer.state.values() for v in s.values()
                        if torch.is_tensor(v)])
        return {"dp_sharding": self.mode, "dp": self.dp.size,
                "trainable_numel": sum(st.unit.numel for st in self.units),
                "params": nbytes([st.unit.full for st in self.units] + [p for _, p in self.frozen]),
                "grads": self._grad_bytes, "optimizer": optim,
                "transient_grad_bucket": self._peak_transient}

