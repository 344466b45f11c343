"""How a sharded flavour cuts the model into units: the keys [zero] and [fsdp] share, and
their checks.

Pure (no torch): the options classes built on it are config tables (registry.OPTIONS).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import ConfigError, UsageError
from hpctrain.option import names, option

__all__ = ["UnitPolicy", "WRAP_POLICIES", "DEFAULT_BUCKET_BYTES", "check_wrap_policy",
           "check_bucket_size"]

WRAP_POLICIES = ("blocks", "class", "size", "none")
#: reduce_bucket_size's default: 16 MiB of gradient pieces in flight.
DEFAULT_BUCKET_BYTES = 1 << 24


def check_wrap_policy(owner: str, table: str, policy: str, wrap_classes: tuple,
                      min_params: int) -> None:
    """Raise UsageError (a ValueError) if the policy fields of options class ``owner`` (config
    table ``table``) do not fit together; the options are built after MPI started, so the
    CLI prints the sentence."""
    if policy not in WRAP_POLICIES:
        raise UsageError(f"{owner}.auto_wrap_policy = {policy!r}: expected one of "
                         f"{', '.join(repr(p) for p in WRAP_POLICIES)}")
    if not isinstance(wrap_classes, tuple):
        raise TypeError(f"{owner}.wrap_classes = {wrap_classes!r}: expected a tuple of class "
                        "names, e.g. ('GPTBlock',)")
    if policy == "class" and not wrap_classes:
        raise UsageError(f"{owner}.auto_wrap_policy = 'class' needs wrap_classes, e.g. "
                         f"('GPTBlock',) (--set {table}.wrap_classes=GPTBlock)")
    if policy == "size" and (not isinstance(min_params, int) or min_params < 1):
        raise UsageError(f"{owner}.auto_wrap_policy = 'size' needs min_params >= 1, got "
                         f"{min_params!r} (--set {table}.min_params=100000)")


def check_bucket_size(owner: str, table: str, key: str, value) -> None:
    """Raise UsageError (a ValueError) unless ``value`` (field ``key`` of options class
    ``owner``, config table ``table``) is a whole number of bytes >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{owner}.{key} = {value!r}: expected a whole number of bytes >= 1, "
                         f"e.g. {DEFAULT_BUCKET_BYTES} (16 MiB; --set {table}.{key}=N)")


@dataclass
class UnitPolicy:
    """How a sharded strategy cuts the model into units (the [zero] and [fsdp] keys).

    ``auto_wrap_policy``: "blocks" (the model's repeated blocks, ``models.structure``),
    "class" (every module whose class name is in ``wrap_classes``), "size" (bottom-up, a
    module whose not-yet-wrapped parameters number at least ``min_params``) or "none" (one
    unit); see ``units.wrapped_modules``. ``wrap_classes``: a tuple of names (in TOML a
    comma-separated string, which the config reads into one).

    ``reduce_bucket_size`` (bytes, as DeepSpeed's): gradients are reduce-scattered during
    backward in pieces of at most this many bytes, with at most this many bytes of piece
    buffers alive at once (in flight or kept for reuse; the backend stages up to as much
    again to receive them): the memory next to the gradients, against how far the
    reductions may lag behind backward."""

    auto_wrap_policy: str = option("blocks", "units: blocks (repeated blocks: ModuleList "
                                   "elements, an nn.Sequential's repeated children), class "
                                   "(wrap_classes), size (min_params) or none (one unit)",
                                   choices=WRAP_POLICIES)
    wrap_classes: tuple = option((), "comma-separated module class names for "
                                 "auto_wrap_policy=class, e.g. GPTBlock")
    min_params: int = option(0, "parameters per unit for auto_wrap_policy=size", min=0)
    reduce_bucket_size: int = option(DEFAULT_BUCKET_BYTES, "bytes: gradients are "
                                     "reduce-scattered in pieces of at most this, with at most "
                                     "this much piece buffer alive at once (zero1 reduces at "
                                     "the step, in place; the MPI backend stages up to as much "
                                     "again to receive)", min=1)

    def check_policy(self, name: str) -> None:
        """The config's check of [name]'s unit policy (ConfigError naming the key; the
        pipeline names its units itself, so its plans skip it)."""
        if self.auto_wrap_policy == "class" and not names(self.wrap_classes):
            raise ConfigError(f"{name}.auto_wrap_policy = 'class' needs {name}.wrap_classes, "
                              f"e.g. --set {name}.wrap_classes=GPTBlock")
        if self.auto_wrap_policy == "size" and self.min_params < 1:
            raise ConfigError(f"{name}.auto_wrap_policy = 'size' needs {name}.min_params >= 1, "
                              f"got {self.min_params}; e.g. --set {name}.min_params=100000")
