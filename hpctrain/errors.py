"""Errors a user can fix by changing their input: the CLI prints the sentence, not a traceback.

A traceback is for bugs. When the message already says what was given, what was expected
and the fix (a missing GPU, wrap classes that match no module, a data set smaller than the
batch), the CLI prints ``hpctrain: error: ...`` with the rank and exits 1. Both classes
subclass ValueError, so API users who catch ValueError keep working.
"""

from __future__ import annotations

__all__ = ["UsageError", "EnvError"]


class UsageError(ValueError):
    """Bad input found after the ranks started; the message names the input and the fix."""


class EnvError(UsageError):
    """An environment variable holds a value hpctrain cannot use; the message names it."""
