"""Learning-rate schedules: constant, warmup_cosine, or any torch.optim.lr_scheduler by name.

The schedule steps once per optimizer step of the loop, after ``par.step``, including a
step the non-finite guard skipped (train.nonfinite = skip): a skipped step still counts
toward train.steps, so the lr of step N is the same whether or not earlier steps were
skipped. Its state goes into each checkpoint (the ``lr_schedule`` attribute, JSON), so a
resumed run continues the same lr per step, at any world size.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.optim import lr_scheduler

from hpctrain.config import ConfigError, TrainSection
from hpctrain.train.optimizers import make_optimizer_factory

__all__ = ["Schedule", "WarmupCosineLR", "warmup_cosine_lr", "make_schedule", "check_schedule",
           "BUILTIN_SCHEDULES"]

BUILTIN_SCHEDULES = ("constant", "warmup_cosine")
# Schedulers the config cannot describe: they take callables or other schedulers.
_NEEDS_CODE = ("LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler")
# Options that default to the run's own numbers when the table leaves them out.
_RUN_DEFAULTS = {"OneCycleLR": {"total_steps": "steps", "max_lr": "lr"},
                 "CosineAnnealingLR": {"T_max": "steps"}}


def warmup_cosine_lr(step: int, lr: float, warmup_steps: int, total_steps: int,
                     min_lr: float = 0.0, start_factor: float = 0.0) -> float:
    """The lr of 0-based optimizer step ``step``: linear from start_factor x lr to lr over
    warmup_steps, then a half cosine from lr to min_lr, reached at total_steps."""
    if step < warmup_steps:
        return lr * (start_factor + (1.0 - start_factor) * step / warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosineLR(lr_scheduler.LRScheduler):
    """warmup_cosine_lr for each param group (from its initial lr); closed form, so the lr
    depends on the step count alone."""

    def __init__(self, optimizer, warmup_steps: int, total_steps: int, min_lr: float = 0.0,
                 start_factor: float = 0.0, last_epoch: int = -1):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.min_lr, self.start_factor = min_lr, start_factor
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        return [warmup_cosine_lr(self.last_epoch, base, self.warmup_steps, self.total_steps,
                                 self.min_lr, self.start_factor) for base in self.base_lrs]


def _scheduler_class(name: str) -> type:
    """The torch.optim.lr_scheduler class called ``name`` (any case); ConfigError if none."""
    classes = {n.lower(): c for n, c in vars(lr_scheduler).items()
               if isinstance(c, type) and issubclass(c, (lr_scheduler.LRScheduler,
                                                         lr_scheduler.ReduceLROnPlateau))
               and c not in (lr_scheduler.LRScheduler, lr_scheduler._LRScheduler)}
    found = classes.get(name.lower())
    usable = sorted(c.__name__ for c in classes.values() if c.__name__ not in _NEEDS_CODE)
    if found is None:
        raise ConfigError(f"train.lr_schedule = {name!r}: expected "
                          f"{', '.join(BUILTIN_SCHEDULES)} or a torch.optim.lr_scheduler class: "
                          f"{', '.join(usable)} (any case)")
    if found.__name__ in _NEEDS_CODE:
        raise ConfigError(f"train.lr_schedule = {name!r} takes functions or other schedulers, "
                          f"which a config cannot give; use warmup_cosine or one of "
                          f"{', '.join(usable)}")
    return found


class Schedule:
    """The run's lr schedule over ``optimizer``: ``step(loss)`` once per optimizer step,
    ``lr()`` the lr of the next step, ``state_dict``/``load_state_dict`` (JSON-able)."""

    def __init__(self, name: str, scheduler=None):
        self.name, self.scheduler = name, scheduler
        self.steps_done = 0

    def step(self, loss: float) -> None:
        self.steps_done += 1
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            # A first step the guard or the fp16 scaler skipped is still a step of the schedule.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            if isinstance(self.scheduler, lr_scheduler.ReduceLROnPlateau):
                self.scheduler.step(loss)
            else:
                self.scheduler.step()

    def state_dict(self) -> dict:
        state = self.scheduler.state_dict() if self.scheduler is not None else {}
        return {"name": self.name, "steps_done": self.steps_done, "state": state}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from a checkpoint's schedule; ValueError if it ran another schedule."""
        name = saved.get("name", "constant")
        if name != self.name:
            raise ValueError(f"the checkpoint was trained with lr_schedule {name!r}, this run "
                             f"has {self.name!r}; resume with --set train.lr_schedule={name}")
        self.steps_done = int(saved.get("steps_done", 0))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["state"])


def make_schedule(optimizer, t: TrainSection) -> Schedule:
    """The configured schedule over optimizer (ConfigError for a bad name or options)."""
    name = t.lr_schedule
    if name == "constant":
        return Schedule(name)
    if name == "warmup_cosine":
        return Schedule(name, WarmupCosineLR(optimizer, t.warmup_steps, t.steps, t.min_lr,
                                             t.warmup_start_factor))
    cls = _scheduler_class(name)
    defaults = {k: getattr(t, field) for k, field in _RUN_DEFAULTS.get(cls.__name__, {}).items()}
    options = {**defaults, **t.lr_schedule_options}
    try:
        return Schedule(name, cls(optimizer, **options))
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"train.lr_schedule = {name!r} with options {options}: "
                          f"{type(exc).__name__}: {' '.join(str(exc).split())}; fix "
                          f"train.lr_schedule_options") from None


def check_schedule(t: TrainSection) -> None:
    """Build the schedule over the configured optimizer of a dummy parameter and step it,
    before MPI (ConfigError). Run check_optimizer first."""
    dummy = torch.nn.Parameter(torch.ones(2, 2))
    optimizer = make_optimizer_factory(t)([dummy])
    schedule = make_schedule(optimizer, t)
    try:
        dummy.grad = torch.full_like(dummy, 0.5)
        optimizer.step()
        schedule.step(1.0)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        raise ConfigError(f"train.lr_schedule = {t.lr_schedule!r}: {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}; fix train.lr_schedule_options") from None
