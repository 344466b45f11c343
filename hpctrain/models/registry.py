"""Build a model, its data set and its loss from a built-in name or a user's factory spec."""

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.data import Dataset

from . import gpt, mlp, unet
from ..errors import ConfigError
from .chain import split_model
from .layers import LayerStack

__all__ = ["BuiltModel", "BUILTIN", "build", "build_deferred", "build_layers", "describe",
           "detect_unit", "check_options"]

_PIPELINES = {"gpt": gpt.pipeline, "mlp": mlp.pipeline}  # layer lists: no weights built
_FACTORIES = {"gpt": gpt.factory, "mlp": mlp.factory, "unet": unet.factory}
_DESCRIPTIONS = {
    "gpt": "tiny GPT decoder (tied embeddings, causal SDPA) on Markov-chain tokens; "
           "defaults " + ", ".join(f"{k}={v}" for k, v in gpt.DEFAULTS.items()),
    "mlp": "Linear+GELU classifier with LayerNorm on teacher-labelled Gaussian inputs; "
           "defaults " + ", ".join(f"{k}={v}" for k, v in mlp.DEFAULTS.items()),
    "unet": "small 2D U-Net on reaction-diffusion fields (HDF5, read by tiles under domain); "
            "defaults " + ", ".join(f"{k}={v}" for k, v in unet.DEFAULTS.items()),
}
BUILTIN = tuple(sorted(_FACTORIES))


@dataclass
class BuiltModel:
    """What build() returns: the model, its data, its loss and how to count throughput."""

    model: nn.Module
    dataset: Dataset
    loss_fn: Callable
    name: str
    unit: str  # "tokens" or "samples"
    units_per_sample: int


def describe():
    """One line per built-in model."""
    return "\n".join(f"{name}: {_DESCRIPTIONS[name]}" for name in BUILTIN)


def detect_unit(dataset):
    """("tokens", target.numel()) for multi-element integer targets (a dict's "labels"),
    else ("samples", 1)."""
    target = dataset[0][1]
    if isinstance(target, dict):
        target = target.get("labels")
    if target is None or isinstance(target, (dict, tuple)):
        return "samples", 1
    target = torch.as_tensor(target)
    if not (target.is_floating_point() or target.is_complex() or target.dtype == torch.bool) \
            and target.numel() > 1:
        return "tokens", int(target.numel())
    return "samples", 1


def _resolve_user(spec):
    """Import 'package.module:attr' and return the attribute; ValueError saying why not."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ValueError(f"model spec {spec!r} is malformed: expected a built-in name "
                         f"({', '.join(BUILTIN)}) or 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure: report it against the spec
        raise ValueError(f"model spec {spec!r}: cannot import module {module_name!r} "
                         f"({type(exc).__name__}: {exc}); fix: make sure the package is on "
                         "PYTHONPATH (or installed) and imports cleanly") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model spec {spec!r}: module {module_name!r} has no attribute "
                             f"{attr!r}; fix: name a factory function defined in that module")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a "
                         "callable; fix: point the spec at a factory function")
    return obj


def _check_result(spec, result):
    """Validate a factory's return value against the (model, dataset, loss_fn) contract."""
    how = ("; fix: the factory must return (nn.Module or models.layers.LayerStack, map-style "
           "Dataset of (input, target) tensor pairs, loss_fn(output, target) -> mean loss)")
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        got = f"{len(result)}-tuple" if isinstance(result, (tuple, list)) \
            else type(result).__name__
        raise ValueError(f"model spec {spec!r}: factory returned a {got}, expected a "
                         f"3-tuple (model, dataset, loss_fn){how}")
    model, dataset, loss_fn = result
    if not isinstance(model, (nn.Module, LayerStack)):
        raise ValueError(f"model spec {spec!r}: the model (item 0) is a "
                         f"{type(model).__name__}, expected a torch.nn.Module or a LayerStack"
                         f"{how}")
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(f"model spec {spec!r}: the dataset (item 1) is a "
                         f"{type(dataset).__name__} without __len__/__getitem__, expected a "
                         f"map-style Dataset{how}")
    if not callable(loss_fn):
        raise ValueError(f"model spec {spec!r}: the loss_fn (item 2) is a "
                         f"{type(loss_fn).__name__}, expected a callable{how}")
    if len(dataset) < 1:
        raise ValueError(f"model spec {spec!r}: the dataset is empty{how}")
    item = dataset[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2
            and all(isinstance(v, torch.Tensor) for v in item)):
        raise ValueError(f"model spec {spec!r}: dataset[0] is not an (input, target) pair of "
                         f"tensors{how}")
    return model, dataset, loss_fn


# Options whose range is not "a count >= 1" (an int) or "a number >= 0" (a float).
_RANGES = {"dropout": (0.0, 1.0, "a probability in [0, 1)")}


def check_options(spec: str, fn, options: dict) -> None:
    """Check a built-in's options against its factory's keyword defaults: the names, the
    types (an int where the default is one, a number for a float, true/false for a bool)
    and the range (sizes and counts >= 1); ConfigError naming train.model_options.KEY."""
    params = {n: p.default for n, p in inspect.signature(fn).parameters.items() if n != "seed"}
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ConfigError(f"train.model_options: model {spec!r} has no option(s) {unknown}; "
                          f"accepted options: {', '.join(params)}")
    for key, value in options.items():
        default = params[key]
        shown = f"train.model_options.{key} = {value!r}"
        want, ok = _expected(default, value)
        if not ok:
            example = str(default).lower() if isinstance(default, bool) else default
            raise ConfigError(f"{shown}: expected {want} for model {spec!r} (default "
                              f"{default!r}); e.g. --set train.model_options.{key}={example}")
        if isinstance(default, bool) or isinstance(default, str):
            continue
        low, high, what = _RANGES.get(key) or ((1, None, "an integer >= 1 (a size or a count)")
                                               if isinstance(default, int) else
                                               (0.0, None, "a finite number >= 0"))
        if not (math.isfinite(value) and value >= low and (high is None or value < high)):
            raise ConfigError(f"{shown}: expected {what} for model {spec!r} (default "
                              f"{default!r})")


def _expected(default, value) -> tuple[str, bool]:
    """(what the default's type asks for, whether value is one)."""
    if isinstance(default, bool):
        return "true or false", isinstance(value, bool)
    if isinstance(default, int):
        return "an integer", isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return "a number", isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return "a string", isinstance(value, str)
    return "", True


def _call(spec, seed, options):
    """(model or LayerStack, dataset, loss_fn) from the spec's factory, checked."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec {spec!r} must be a non-empty string: a built-in name "
                         f"({', '.join(BUILTIN)}) or 'package.module:factory'")
    if ":" in spec:
        fn = _resolve_user(spec)
        if options:
            raise ValueError(f"model spec {spec!r}: options {sorted(options)} are only "
                             "accepted by built-in models; fix: bake them into your factory "
                             "(it is called with no arguments)")
        call = fn
    elif spec in _FACTORIES:
        fn = _FACTORIES[spec]
        check_options(spec, fn, options)
        call = lambda: fn(seed, **options)  # noqa: E731
    else:
        raise ValueError(f"unknown model {spec!r}: expected one of the built-ins "
                         f"({', '.join(BUILTIN)}) or a user factory as "
                         "'package.module:factory'")
    # Seed right before construction so every rank builds identical weights; fork keeps the
    # caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _check_result(spec, call())


def build(spec, seed, **options):
    """Build `spec` (a name in BUILTIN or 'package.module:factory') with weights from `seed`.
    A factory's LayerStack is built whole (``LayerStack.module()``)."""
    model, dataset, loss_fn = _call(spec, seed, options)
    if isinstance(model, LayerStack):
        model = model.module()
    unit, per_sample = detect_unit(dataset)
    return BuiltModel(model, dataset, loss_fn, spec, unit, per_sample)


def build_layers(spec, seed, **options):
    """Like build(), but ``model`` is a LayerStack that builds layers on demand (pipeline).

    Built-in models build no weights here; a user factory's model is built whole once and
    must be a chain (an nn.Sequential, a known architecture or embeddings -> blocks -> head:
    models/chain.py), checked against the model's forward on the first two samples.
    """
    if spec in _PIPELINES:
        check_options(spec, _PIPELINES[spec], options)
        stack, dataset, loss_fn = _PIPELINES[spec](seed, **options)
    else:
        model, dataset, loss_fn = _call(spec, seed, options)
        stack = model if isinstance(model, LayerStack) else split_model(model, _sample(dataset))
    unit, per_sample = detect_unit(dataset)
    return BuiltModel(stack, dataset, loss_fn, spec, unit, per_sample)


def _sample(dataset) -> torch.Tensor:
    """A batch of the data set's first (up to) two inputs, to check a model's split."""
    return torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(2, len(dataset)))])


def build_deferred(spec, seed, **options):
    """(BuiltModel, LayerStack or None) for a plan where no rank keeps the whole model.

    A built-in described layer by layer (gpt, mlp), or a factory returning a LayerStack:
    the model is built on the meta device and the stack is returned, for
    parallel/deferred.py to fill what each rank keeps; nothing is materialised here. A
    factory's nn.Module exists whole once returned: it comes back as built, with None.
    Built-ins not described layer by layer: None (build them with ``build``)."""
    if isinstance(spec, str) and spec in _PIPELINES:
        layered = build_layers(spec, seed, **options)  # the stack (no weights), data, loss
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            model = _FACTORIES[spec](seed, **options)[0]  # its data (meta here) is dropped
        stack = layered.model
    elif isinstance(spec, str) and ":" in spec:
        model, dataset, loss_fn = _call(spec, seed, options)
        stack = model if isinstance(model, LayerStack) else None
        if stack is not None:
            with torch.device("meta"):
                model = stack.module()
        unit, per_sample = detect_unit(dataset)
        return BuiltModel(model, dataset, loss_fn, spec, unit, per_sample), stack
    else:
        return None
    built = BuiltModel(model, layered.dataset, layered.loss_fn, spec, layered.unit,
                       layered.units_per_sample)
    return built, stack
