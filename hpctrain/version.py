"""The package version: one place, read by setup.cfg, checkpoints, ``doctor`` and ``--version``."""

__version__ = "0.1.0"
