"""Flat parameter units: a group of parameters viewed into one padded buffer, sharded over ranks.

Shared infrastructure of the sharded strategies (zero, fsdp). A unit's trainable parameters
are copied into one flat buffer padded to a multiple of the world size, and each parameter's
``.data`` becomes a view of it; rank r owns the contiguous slice ``[r*S, (r+1)*S)``. Any
parameter count shards over any world size; the padding is zero and stays zero.
"""

from __future__ import annotations

import bisect
import ctypes
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.parallel.deferred import filled, values
from hpctrain.runtime.comm import Communicator

__all__ = ["FlatUnit", "Slot"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its unit's flat buffer."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: tuple

    def owned(self, lo: int, hi: int) -> tuple[int, int]:
        """The part [a, b) of this parameter's flat elements inside the flat range [lo, hi)."""
        a = min(max(lo - self.offset, 0), self.numel)
        b = min(max(hi - self.offset, 0), self.numel)
        return a, max(a, b)


class FlatUnit:
    """The flat buffer of one unit's parameters and this rank's shard of it.

    ``keep_full``: the full buffer stays allocated and the shard parameter is a view of it
    (zero1/zero2); otherwise the shard has its own storage and the full buffer exists only
    between ``gather()`` and ``free()`` (zero3/fsdp).

    ``compute_dtype`` (mixed precision): the full buffer, and so the parameters the model
    computes with, have this dtype while the shard keeps the parameters' own (fp32 master).
    ``shard_device`` (CPU offload): the shard lives there; gathering copies it to the device.
    """

    def __init__(self, name: str, named_params: list[tuple[str, nn.Parameter]],
                 comm: Communicator, keep_full: bool, compute_dtype: torch.dtype | None = None,
                 shard_device: torch.device | None = None):
        if not named_params:
            raise ValueError(f"unit {name!r} has no parameters; build units only over modules "
                             "that own trainable parameters")
        dtypes = {p.dtype for _, p in named_params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"unit {name!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "a flat buffer needs one floating dtype: cast the model first "
                             "(e.g. model.float())")
        self.name = name
        self.comm = comm
        self.keep_full = keep_full
        dtype, device = named_params[0][1].dtype, named_params[0][1].device
        cdtype = compute_dtype or dtype
        sdevice = torch.device(shard_device) if shard_device is not None else device
        if keep_full and (cdtype != dtype or sdevice != device):
            raise ValueError(f"unit {name!r}: a full buffer that the shard views (keep_full) "
                             "cannot have another dtype or device than the shard; pass "
                             "keep_full=False with compute_dtype or shard_device")
        slots, offset = [], 0
        for pname, p in named_params:
            slots.append(Slot(pname, p, offset, p.numel(), tuple(p.shape)))
            offset += p.numel()
        self.slots = slots
        self._starts = [s.offset for s in slots]  # for bisect in grad_range
        self.numel = offset
        n = max(comm.size, 1)
        self.padded = -(-offset // n) * n  # ceil to a multiple of the world size
        self.shard_numel = self.padded // n
        self.lo = comm.rank * self.shard_numel
        self.hi = self.lo + self.shard_numel
        with torch.no_grad():
            if keep_full:
                self.full = torch.zeros(self.padded, dtype=dtype, device=device)
                for s in slots:
                    self.full[s.offset:s.offset + s.numel].copy_(
                        values(s.param, copy=False).reshape(-1))
                self.shard = nn.Parameter(self.full[self.lo:self.hi])
            else:
                # Only this rank's part of each parameter is read: under deferred init
                # (parallel/deferred.py) no rank ever fills a whole unit at build.
                shard = torch.zeros(self.shard_numel, dtype=dtype, device=sdevice)
                for s in slots:
                    lo, hi = s.owned(self.lo, self.hi)
                    if hi > lo:
                        at = s.offset + lo - self.lo
                        shard[at:at + hi - lo].copy_(values(s.param, copy=False).reshape(-1)[lo:hi])
                self.shard = nn.Parameter(shard)
                self.full = torch.empty(self.padded, dtype=cdtype, device=device)  # untouched
            for s in slots:
                s.param.data = self.full[s.offset:s.offset + s.numel].view(s.shape)
                filled(s.param)
        self.gathered = True
        self._pending = None  # a started gather: (request, staging tensor or None)
        self._nbytes = self.full.untyped_storage().nbytes()
        # Without keep_full a unit starts freed (the shard holds its values), so building unit
        # after unit never holds the whole model: its first gather fills it.
        self.free()

    # ---- the full buffer ---------------------------------------------------------------

    def gather(self) -> None:
        """Fill the full buffer from every rank's shard (collective over comm); completes a
        gather started by ``gather_start`` instead when there is one."""
        if self._pending is not None:
            self.gather_wait()
            return
        if not self.keep_full and self.gathered:
            return
        if self.keep_full:
            self._resize_full()
            self.comm.allgather(self.shard.detach().clone(), out=self.full)
            self.gathered = True
            return
        self._land(self._gather_into(blocking=True))

    def gather_start(self) -> None:
        """Start filling the full buffer (non-blocking collective over comm: every rank
        starts it in the same order relative to the comm's other collectives); ``gather()``
        or ``gather_wait()`` completes it. Its memory is allocated now (``pending``). A unit
        that keeps its full buffer gathers at once."""
        if self._pending is not None or (self.gathered and not self.keep_full):
            return
        if self.keep_full:
            self.gather()
            return
        self._pending = self._gather_into(blocking=False)

    def gather_wait(self) -> None:
        """Complete a gather started by ``gather_start`` (no-op when none is pending)."""
        if self._pending is None:
            return
        req, tmp = self._pending
        self._pending = None
        req.wait()
        self._land(tmp)

    @property
    def pending(self) -> bool:
        """A gather is started and not yet completed (the full buffer is allocated)."""
        return self._pending is not None

    def _resize_full(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() != self._nbytes:
            storage.resize_(self._nbytes)  # the same storage: autograd's saved views stay valid

    def _gather_into(self, blocking: bool):
        """All-gather a sharded unit's shards into its full buffer: blocking, the tensor to
        copy in (None: gathered in place); non-blocking, (request, that tensor) started."""
        self._resize_full()
        src = self.shard.detach()
        if src.dtype != self.full.dtype or src.device != self.full.device:
            src = src.to(self.full.device, self.full.dtype)  # mixed precision / offload
        gather = self.comm.allgather if blocking else self.comm.iallgather
        if self.full.device.type == "cpu":
            # The MPI backend hands numpy views to MPI, and a numpy view makes a storage
            # non-resizable for good: gather into an alias of the same memory with its own
            # storage instead (no second full-size buffer; a request keeps the alias).
            # Writing through the alias keeps full's version counter (the values are the
            # ones autograd saved before the free).
            got = gather(src, out=_alias(self.full))  # the alias, or the request
            return None if blocking else (got, None)
        got = gather(src)  # a new tensor, or the request of one
        return got if blocking else (got, got.out)

    def _land(self, tmp) -> None:
        """The gather is complete: copy a staged result into the full buffer."""
        if tmp is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
                self.full.copy_(tmp)
        self.gathered = True

    def free(self) -> None:
        """Release the full buffer's memory (sharded units only; the shard keeps the values).
        A started gather is completed first (its collective must complete on every rank)."""
        self.gather_wait()
        if self.keep_full or not self.gathered:
            return
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def full_bytes(self) -> int:
        """Bytes of the full buffer when gathered."""
        return self._nbytes

    # ---- gradients ---------------------------------------------------------------------

    def point_grads(self, grad_buf: torch.Tensor) -> None:
        """Make every param's .grad (and the shard's) a view of the flat gradient buffer, so
        autograd accumulates in place; a .grad someone replaced (zero_grad, set_to_none)
        is copied in, or zeroed when missing."""
        for s in self.slots:
            view = grad_buf[s.offset:s.offset + s.numel]
            g = s.param.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g.reshape(-1))
            s.param.grad = view.view(s.shape)
        self.shard.grad = grad_buf[self.lo:self.hi]

    def reduce_grad_buffer(self, grad_buf: torch.Tensor, comm) -> None:
        """Persistent gradients: reduce-scatter (SUM over ``comm``) the flat gradient buffer
        into this rank's shard of it, the shard's .grad (collective over ``comm``)."""
        self.point_grads(grad_buf)  # after a zero_grad(): back at the buffer
        tmp = comm.reduce_scatter(grad_buf, op="sum")
        grad_buf[self.lo:self.hi].copy_(tmp)

    def add_shard_grad(self, part: torch.Tensor) -> None:
        """Accumulate ``part`` into the shard's .grad (set it when there is none)."""
        if self.shard.grad is None:
            self.shard.grad = part
        else:
            self.shard.grad.add_(part)

    def grad_range(self, lo: int, hi: int, out: torch.Tensor, grads: list) -> torch.Tensor:
        """Copy flat elements [lo, hi) of the packed gradient into out (missing grads and
        padding as zeros) without packing the whole unit; grads[j]: slot j's flat grad or None."""
        out.zero_()
        j = bisect.bisect_right(self._starts, lo) - 1
        for s, g in zip(self.slots[max(j, 0):], grads[max(j, 0):]):
            if s.offset >= hi:
                break
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if g is not None and b > a:
                out[a - lo:b - lo].copy_(g[a - s.offset:b - s.offset])
        return out

    def owned_ranges(self, slots=None) -> list[tuple[int, int]]:
        """Shard-local [a, b) ranges of the given slots' elements that this rank owns."""
        out = []
        for s in slots if slots is not None else self.slots:
            a, b = s.owned(self.lo, self.hi)
            if b > a:
                out.append((s.offset + a - self.lo, s.offset + b - self.lo))
        return out

    def shard_view(self, slot: Slot) -> tuple[tuple[int, int], torch.Tensor]:
        """(the [a, b) elements of slot's flattened parameter this rank owns, their shard view)."""
        a, b = slot.owned(self.lo, self.hi)
        start = slot.offset + a - self.lo
        return (a, b), self.shard.detach()[start:start + (b - a)]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over t's memory with a storage of its own (t must outlive it)."""
    buf = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that it does not copy: intended
        return torch.frombuffer(buf, dtype=t.dtype)
