"""The optimizer a run steps: torch.optim classes by name, user factories, and the rules of
which optimizers each flavour can drive."""

from __future__ import annotations

import importlib
import inspect

import torch

from hpctrain import registry
from hpctrain.config import ConfigError, TrainSection

__all__ = ["make_optimizer_factory", "check_optimizer", "optimizer_class", "NOT_SHARDABLE",
           "UNDRIVABLE"]

# Optimizers whose update of an element reads other elements of the same tensor (factored
# moments, orthogonalised matrices): on the sharded flavours' flat 1-D shards they would
# compute something else than on whole tensors, so those flavours refuse them.
NOT_SHARDABLE = ("Adafactor", "Muon")
# Optimizers the strategies' step cannot drive, and why.
UNDRIVABLE = {"LBFGS": "its step re-evaluates the loss through a closure, which the training "
                       "loop does not give",
              "SparseAdam": "it needs sparse gradients, and the strategies make dense ones"}


def optimizer_class(name: str) -> type:
    """The torch.optim class called ``name`` (case-insensitive); ConfigError if none is."""
    classes = _torch_optimizers()
    found = classes.get(name.lower())
    if found is None:
        raise ConfigError(f"train.optimizer = {name!r}: not a torch.optim optimizer; expected "
                          f"one of {', '.join(sorted(c.__name__ for c in classes.values()))} "
                          f"(any case) or a factory package.module:callable")
    return found


def _torch_optimizers() -> dict:
    return {n.lower(): c for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
            and c is not torch.optim.Optimizer}


def _user_factory(spec: str):
    """Import ``package.module:callable``; ConfigError if it is not there."""
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"train.optimizer = {spec!r}: cannot import it ({exc}); give "
                          f"package.module:callable on PYTHONPATH") from None
    if not callable(factory):
        raise ConfigError(f"train.optimizer = {spec!r} is not callable; give a function "
                          f"(params, lr, **optimizer_options) -> torch.optim.Optimizer")
    return factory


def _class_kwargs(cls: type, t: TrainSection) -> dict:
    """lr, and weight_decay / momentum where the class takes them (their config values, so
    sgd and adamw behave as they always did), then train.optimizer_options over them."""
    accepted = inspect.signature(cls).parameters
    kwargs = {"lr": t.lr}
    kwargs.update({k: getattr(t, k) for k in ("weight_decay", "momentum") if k in accepted})
    # TOML has no tuples: betas = [0.9, 0.95] is passed as the tuple torch documents.
    kwargs.update({k: tuple(v) if isinstance(v, list) else v
                   for k, v in t.optimizer_options.items()})
    return kwargs


def make_optimizer_factory(t: TrainSection):
    """Return params -> optimizer for the configured optimizer (every strategy calls it:
    the sharded flavours with their flat shards)."""
    if ":" in t.optimizer:
        factory = _user_factory(t.optimizer)
        options = dict(t.optimizer_options)
        return lambda params: factory(params, t.lr, **options)
    cls = optimizer_class(t.optimizer)
    kwargs = _class_kwargs(cls, t)
    return lambda params: cls(params, **kwargs)


def check_optimizer(t: TrainSection, flavour: str | None = None) -> None:
    """Build the configured optimizer over a dummy parameter and step it once, so a bad name,
    a bad keyword or an optimizer the training loop cannot drive (LBFGS needs a closure,
    SparseAdam sparse gradients) is a ConfigError before MPI starts. ``flavour``: the plan's
    data-parallel flavour (the sharded ones refuse NOT_SHARDABLE)."""
    if "lr" in t.optimizer_options:
        raise ConfigError("train.optimizer_options.lr is set: the learning rate is train.lr "
                          "(--lr), which the schedules start from; drop it from the table")
    make = make_optimizer_factory(t)
    cls = None if ":" in t.optimizer else optimizer_class(t.optimizer)
    if cls is not None and cls.__name__ in UNDRIVABLE:
        raise ConfigError(f"train.optimizer = {t.optimizer!r}: {UNDRIVABLE[cls.__name__]}; "
                          f"pick another optimizer")
    if (cls is not None and cls.__name__ in NOT_SHARDABLE
            and flavour in registry.SHARDED_FLAVOURS):
        raise ConfigError(f"train.optimizer = {t.optimizer!r} does not update element by "
                          f"element, so it cannot run on the flat shards of {flavour}; use an "
                          f"elementwise optimizer (AdamW, SGD, Adagrad, ...) or a ddp/single plan")
    dummy = torch.nn.Parameter(torch.ones(2, 2))
    try:
        optimizer = make([dummy])
        dummy.grad = torch.full_like(dummy, 0.5)
        optimizer.step()
    except (TypeError, ValueError, RuntimeError, KeyError) as exc:
        raise ConfigError(f"train.optimizer = {t.optimizer!r} with options "
                          f"{dict(t.optimizer_options)}: {type(exc).__name__}: "
                          f"{_one_line(exc)}; fix train.optimizer_options") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"train.optimizer = {t.optimizer!r} returned "
                          f"{type(optimizer).__name__}, not a torch.optim.Optimizer")


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
