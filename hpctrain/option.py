"""A config key declared on its dataclass field: its default, help line and bounds.

Pure (imports nothing from hpctrain): the config's own tables and every parallelism's
options class (each IS its config table, registry.OPTIONS) declare their keys with it, and
config.py checks values and the CLI writes its help from the metadata.
"""

from __future__ import annotations

from dataclasses import field

__all__ = ["option", "given", "names"]


def option(default, help, *, choices=None, min=None, max=None, default_factory=None):
    """A config key: ``help`` is its one line in the CLI help; ``choices``, ``min`` and
    ``max`` are checked before any collective."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def given(default, help, *, default_factory=None):
    """A field the run fills in (from [train] or the plan), not a key of the table: the
    config neither reads nor writes it."""
    meta = {"help": help, "config": False}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def names(text) -> tuple:
    """A tuple key's value from its TOML form, comma-separated names ('GPTBlock, MLPBlock'
    -> ('GPTBlock', 'MLPBlock')); a tuple stays as it is."""
    if isinstance(text, str):
        return tuple(c.strip() for c in text.split(",") if c.strip())
    return text
