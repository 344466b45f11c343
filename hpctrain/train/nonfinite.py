"""The non-finite guard: what training does when the loss or the gradients stop being finite.

``train.nonfinite`` chooses (checked before the optimizer steps, so a NaN never reaches the
parameters, the optimizer state or a checkpoint):

* ``stop`` (default): every rank raises :class:`NonFiniteError` at the same step, naming the
  step and the first non-finite value's source (the loss, or which parameter's gradient);
  the CLI prints that sentence and exits with ``NONFINITE_EXIT_CODE`` (3) on every rank. No
  checkpoint is written or rotated from that state: the newest good one stays, and
  ``--resume auto`` picks it.
* ``skip``: the step's gradients are dropped, the optimizer does not step (its state and
  step count stay as they were); rank 0 logs one line per skipped step. After
  ``train.nonfinite_max_skips`` skipped steps in a row, the next non-finite step stops as
  ``stop`` does. A finite step resets the count.
  The lr schedule still advances over a skipped step (it counts toward train.steps:
  train/schedule.py).
* ``ignore``: step anyway. A checkpoint of non-finite parameters is still never written:
  that save is left out with a line saying so.

What is checked, on values every rank agrees on, so every rank decides alike: the
all-reduced loss, then the global gradient norm (the clipping norm when
``--max-grad-norm`` is set; else one scalar all-reduce per step, the only cost of the guard
on a healthy step). Only on the failure path is the source named: each rank lists its
parameters whose gradient holds a NaN or inf (the sharded flavours: the elements of the
shard it owns, by slot), one allgather of those lists, and the first name in a canonical
order (each name where it first appears going over the ranks in order, each rank's
parameters in model order) is reported.

fp16: a step whose gradients overflowed is the GradScaler's to skip (it lowers the scale);
such steps are not guard events. The guard acts when the scaler cannot help: the
loss itself (unscaled, fp32) is not finite, or the gradients are not finite although the
loss scale has already fallen below ``SCALE_FLOOR`` (1.0: they overflow even unscaled;
from the initial 2**16 that is 17 overflowed steps in a row).
"""

from __future__ import annotations

import math

from hpctrain.config import NONFINITE_MODES as MODES
from hpctrain.errors import NONFINITE_EXIT_CODE, UsageError

__all__ = ["NonFiniteError", "NonFiniteGuard", "NONFINITE_EXIT_CODE", "MODES", "SCALE_FLOOR"]

SCALE_FLOOR = 1.0


class NonFiniteError(UsageError):
    """The loss, a gradient or the parameters became NaN/inf; raised on every rank at the
    same step. The CLI exits with NONFINITE_EXIT_CODE."""

    exit_code = NONFINITE_EXIT_CODE


class NonFiniteGuard:
    """Decide, once per optimizer step and alike on every rank, whether the step may run.

    The trainer sets ``step`` (1-based) and ``loss`` (all-reduced) before calling
    ``par.step(..., guard=self)``; the strategy's step calls :meth:`check` after the
    gradients are final (synced, unscaled, clipped) and before the optimizer steps.
    ``latest()`` names the newest good checkpoint for the message; ``name_of`` maps a local
    parameter name to its global one (a pipeline's tied copies); ``mpi_comm`` is the job's
    mpi4py communicator (None: one process).
    """

    def __init__(self, mode: str, max_skips: int, mpi_comm=None, is_main: bool = True,
                 latest=lambda: "none", name_of=None):
        if mode not in MODES:
            raise ValueError(f"train.nonfinite = {mode!r}: expected one of {', '.join(MODES)}")
        self.mode, self.max_skips = mode, max_skips
        self.mpi_comm = mpi_comm if mpi_comm is not None and mpi_comm.Get_size() > 1 else None
        self.is_main = is_main
        self.latest = latest
        self.name_of = name_of or (lambda name: name)
        self.step: int | None = None
        self.loss: float | None = None
        self.in_a_row = 0   # skipped steps in a row (skip mode)
        self.skipped = 0    # skipped steps in this run
        self.norm: float | None = None  # this step's global gradient norm, if one was computed

    def check(self, par, scaler=None, norm: float | None = None) -> bool:
        """True: let the optimizer step. False: skip it (the caller drops the gradients and,
        with a scaler, updates it). Raises NonFiniteError to stop. Collective: every rank
        calls it and gets the same answer. ``norm``: the global gradient norm if already
        computed (clipping), else it is computed here. The norm is kept in ``self.norm``
        for the step's metrics (None when neither clipping nor the guard computed one)."""
        self.norm = norm
        if self.mode == "ignore":
            return True
        source = None
        if self.loss is not None and not math.isfinite(self.loss):
            source = f"the loss is {self.loss}"
        else:
            if norm is None:
                norm = self.norm = par._grad_norm()
            if not math.isfinite(norm):
                what = f"grad norm {norm}"
                if scaler is not None:
                    scale = float(scaler.get_scale())
                    # the scale may differ between pipeline stages: agree (failure path only)
                    low = self._any(scale < SCALE_FLOOR)
                    if not low:
                        return True  # an overflow: the scaler skips the step and lowers the scale
                    what += f", fp16 loss scale {scale:g} < {SCALE_FLOOR:g}: they overflow unscaled"
                source = self._grad_source(par, what)
        if source is None:
            self.in_a_row = 0
            return True
        return self._failed(source)

    def decide(self, step: int, loss: float, norm: float, bad: list) -> bool:
        """:meth:`check` for a step already taken on the device (train/device_step.py: the
        optimizer stepped with found_inf, so a non-finite step changed nothing), read a step
        later: ``bad`` lists the parameters, in model order, whose gradient was not finite.
        One process only (no agreement needed). True: the step counted; False: skipped;
        raises NonFiniteError to stop."""
        self.step, self.loss, self.norm = step, loss, norm
        if self.mode == "ignore":
            return True
        source = None
        if not math.isfinite(loss):
            source = f"the loss is {loss}"
        elif not math.isfinite(norm):
            source = self._first_bad([self.name_of(n) for n in bad], f"grad norm {norm}")
        if source is None:
            self.in_a_row = 0
            return True
        return self._failed(source)

    def _failed(self, source: str) -> bool:
        """Skip the step (False) or raise, as the mode and the skips in a row say."""
        if self.mode == "skip" and self.in_a_row < self.max_skips:
            self.in_a_row += 1
            self.skipped += 1
            if self.is_main:
                print(f"hpctrain: step {self.step}: {source}; step skipped (gradients dropped, "
                      f"no optimizer step; {self.in_a_row} of at most {self.max_skips} in a "
                      f"row)", flush=True)
            return False
        after = (f" after {self.in_a_row} skipped step{'s' if self.in_a_row != 1 else ''} in a "
                 f"row (train.nonfinite_max_skips = {self.max_skips})"
                 if self.mode == "skip" else "")
        raise NonFiniteError(
            f"step {self.step}: {source}; stopped{after} without writing a checkpoint (the "
            f"newest good one is {self.latest()}). Lower --lr or set --max-grad-norm")

    def _any(self, flag: bool) -> bool:
        if self.mpi_comm is None:
            return bool(flag)
        return any(self.mpi_comm.allgather(bool(flag)))

    def _grad_source(self, par, what: str) -> str:
        """"gradient of 'name' is not finite (what)": the first parameter, in the canonical
        order, whose gradient holds a NaN/inf on some rank (one allgather)."""
        names, bad = par._nonfinite_grads()
        mine = ([self.name_of(n) for n in names], {self.name_of(n) for n in bad})
        every = self.mpi_comm.allgather(mine) if self.mpi_comm is not None else [mine]
        order, found = {}, set()
        for rank_names, rank_bad in every:
            for n in rank_names:
                order.setdefault(n, len(order))
            found |= rank_bad
        return self._first_bad(sorted(found, key=lambda n: order.get(n, len(order))), what)

    @staticmethod
    def _first_bad(found: list, what: str) -> str:
        """The failure's sentence from the non-finite gradients' names, in canonical order."""
        if not found:  # e.g. a norm that overflowed float64 from finite elements
            return f"the gradients are not finite ({what})"
        first = found[0]
        more = len(found) - 1
        also = f"; {more} other parameter gradient{'s' if more != 1 else ''} too" if more else ""
        return f"gradient of {first!r} is not finite ({what}{also})"
