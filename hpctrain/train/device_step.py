"""Optimizer steps with no host read inside them: the GPU never waits for the host.

The synchronous step reads the loss and the gradient norm on the host before the optimizer
steps (the non-finite guard decides from them), so every step the GPU drains, idles while
the host decides and launches, and only then gets the next step's kernels: on an H100 the
built-in GPT at 124M parameters ran 17% slower than a plain torch loop, 90% of it from those
two reads (``bench gpu``). Here the step's decision is made ON THE DEVICE and read a step
later:

* the loss, the global gradient norm and each parameter's gradient norm are computed on the
  device (float64) and copied to pinned host memory behind a CUDA event, without a sync;
* clipping scales the gradients by ``min(1, max_norm / (norm + 1e-6))`` on the device;
* the optimizer steps with ``found_inf`` (the flag torch's fused optimizers take from
  GradScaler): a non-finite step changes neither the parameters nor the optimizer state,
  its step count included, exactly what the guard's skip does;
* the host reads step N's values while the GPU runs step N+1, and the guard decides from
  them then (``NonFiniteGuard.decide``): stop raises naming step N and its first non-finite
  gradient; skip counts and logs it. A checkpoint, a pre-emption stop and the end of
  training read every pending step first, so nothing is saved from a state the guard has
  not passed.

Used where it is exact and needs no other reads (``unsupported`` says why not): the plan's
step is the plain one of one process (``single``, or any strategy whose forward, backward,
norm and step are Parallelized's at world size 1), no fp16 loss scaler (its overflow
check reads the host), an optimizer that takes ``found_inf`` (``fused=True``: Adam, AdamW,
SGD), no callbacks and no ReduceLROnPlateau (they read each step's loss). Everything else
keeps the synchronous step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hpctrain.data.structure import call_model
from hpctrain.parallel.base import Parallelized
from hpctrain.runtime.abort import set_context

__all__ = ["DeviceSteps", "Resolved", "unsupported"]


def unsupported(par, world, precision, callbacks, schedule) -> str | None:
    """Why steps cannot run without host reads here (None: they can)."""
    from torch.optim import lr_scheduler

    kind = type(par)
    if world.size != 1 or par.job_comm is not None and par.job_comm.size > 1:
        return "more than one rank"
    for name in ("forward_backward", "step", "_grad_norm", "_clip", "_optimizer_step",
                 "_sync_grads", "backward"):
        if getattr(kind, name) is not getattr(Parallelized, name):
            return f"the plan's {name} is its own"
    if precision.scaler is not None:
        return "the fp16 loss scaler"
    opt = par.optimizer
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return f"{type(opt).__name__} does not take found_inf (use fused=True)"
    if callbacks:
        return "callbacks read every step's loss"
    if isinstance(getattr(schedule, "scheduler", None), lr_scheduler.ReduceLROnPlateau):
        return "ReduceLROnPlateau reads every step's loss"
    return None


@dataclass
class Resolved:
    """One step's values, read on the host a step late."""

    step: int        # 0-based, as the trainer's loop counts
    loss: float
    norm: float
    dt: float        # host seconds the step's launch took (its share of the loop)
    names: list      # parameter names whose gradient was not finite (empty: all finite)


class _Pending:
    """A step's device values on their way to pinned host memory (an event marks arrival)."""

    def __init__(self, step: int, values: torch.Tensor, names: list, dt: float):
        self.step, self.names, self.dt = step, names, dt
        self.host = torch.empty(values.shape, dtype=values.dtype,
                                pin_memory=values.device.type == "cuda")
        self.host.copy_(values, non_blocking=values.device.type == "cuda")
        self.event = None
        if values.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> Resolved:
        if self.event is not None:
            self.event.synchronize()  # this step's values only, not the work queued after
        loss, norm, *norms = self.host.tolist()
        bad = [n for n, v in zip(self.names, norms) if v != v or v in (float("inf"), float("-inf"))]
        return Resolved(self.step, loss, norm, self.dt, bad)


class DeviceSteps:
    """Launch steps whose decision is taken on the device; read each a step later."""

    def __init__(self, par, guard, precision, max_grad_norm: float):
        self.par, self.guard, self.precision = par, guard, precision
        self.max_grad_norm = max_grad_norm
        self.ignore = guard.mode == "ignore"
        self.pending: list[_Pending] = []
        self._weight_key, self._weight_tensor = None, None

    def launch(self, step: int, micro_batches, loss_fn) -> list[Resolved]:
        """Queue step ``step`` on the device; return the earlier steps now read (at most one,
        the previous), each already passed by the guard (which may raise)."""
        t0 = time.perf_counter()
        par, precision = self.par, self.precision
        local = None
        for x, y, weight in micro_batches:
            set_context(phase="forward")
            with precision.autocast():
                loss = loss_fn(call_model(par.model, x), y)
            set_context(phase="backward")
            par.backward(loss * weight)
            term = loss.detach().double() * weight
            local = term if local is None else local + term
        set_context(phase="optimizer")
        named = [(n, p) for n, p in par.model.named_parameters() if p.grad is not None]
        device = named[0][1].grad.device if named else torch.device("cpu")
        if local is None:
            local = torch.zeros((), dtype=torch.float64, device=device)
        values = self._decide(named, local.to(device))
        self.pending.append(_Pending(step, values, [n for n, _ in named],
                                     time.perf_counter() - t0))
        return self.read(keep=1)

    def _decide(self, named, local: torch.Tensor) -> torch.Tensor:
        """Norms, clipping and the gated optimizer step, all on the device; returns
        [loss, norm, per-parameter norms...] (float64) for the host to read later."""
        par = self.par
        grads = [p.grad for _, p in named]
        if grads:
            norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
            norm = (norms.square() * self._weights(named, norms.device)).sum().sqrt()
        else:
            norms = torch.zeros(0, dtype=torch.float64, device=local.device)
            norm = torch.zeros((), dtype=torch.float64, device=local.device)
        if self.max_grad_norm > 0 and grads:
            # as Parallelized._clip: scale only when finite and above the limit (a factor of 1
            # otherwise, which leaves every gradient bit for bit as it was)
            scale = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            scale = torch.where(torch.isfinite(norm), scale, torch.ones_like(scale))
            torch._foreach_mul_(grads, scale.float())
        opt = par.optimizer
        if not self.ignore:
            found = (~(torch.isfinite(local) & torch.isfinite(norm))).float()  # 0-d, as GradScaler
            opt.grad_scale, opt.found_inf = None, found
        try:
            opt.step()
        finally:
            for attr in ("grad_scale", "found_inf"):
                if hasattr(opt, attr):
                    delattr(opt, attr)
        opt.zero_grad()
        return torch.cat([local.reshape(1), norm.reshape(1), norms])

    def _weights(self, named, device) -> torch.Tensor:
        """Each gradient's weight in the global norm (Parallelized._norm_weight), on the
        device. Built once per set of parameters with gradients: ``torch.tensor(...,
        device=cuda)`` copies synchronously, a sync of its own every step otherwise."""
        key = tuple(id(p) for _, p in named)
        if self._weight_key != key:
            host = torch.tensor([self.par._norm_weight(p) for _, p in named],
                                dtype=torch.float64)
            self._weight_tensor = host.to(device)  # once: a sync here costs nothing
            self._weight_key = key
        return self._weight_tensor

    def read(self, keep: int = 0) -> list[Resolved]:
        """Read every pending step but the newest ``keep``; the guard passes each in order."""
        done = []
        while len(self.pending) > keep:
            got = self.pending.pop(0).read()
            self.guard.decide(got.step + 1, got.loss, got.norm, got.names)
            done.append(got)
        return done
