"""Errors a user can fix by changing their input: the CLI prints the sentence, not a traceback.

A traceback is for bugs. When the message already says what was given, what was expected
and the fix (a missing GPU, wrap classes that match no module, a data set smaller than the
batch), the CLI prints ``hpctrain: error: ...`` once and exits 2 (found before training)
or 1 (found while training); an API script that does not catch it prints the same line
(runtime/abort.py). Every class subclasses ValueError, so API users who catch ValueError
keep working.
"""

from __future__ import annotations

__all__ = ["UserInputError", "ConfigError", "UsageError", "EnvError", "SetupError", "SetupTypeError",
           "as_setup_error", "NONFINITE_EXIT_CODE"]

#: The exit code of a run the non-finite guard stopped (train/nonfinite.py NonFiniteError).
NONFINITE_EXIT_CODE = 3


class UserInputError(ValueError):
    """Base of the errors in what the user gave."""


class ConfigError(UserInputError):
    """A config value is wrong; the message names the key, the value and the fix (also
    importable from hpctrain.config)."""


class UsageError(UserInputError):
    """Bad input found after the ranks started; the message names the input and the fix."""


class EnvError(UsageError):
    """An environment variable holds a value hpctrain cannot use; the message names it."""


class SetupError(UsageError):
    """The model or an option cannot run under the plan, found while building it (after MPI
    started, before the first step): the same on every rank, so the CLI exits 2."""


class SetupTypeError(SetupError, TypeError):
    """A SetupError from a TypeError (a model of the wrong kind): still a TypeError."""


def as_setup_error(exc: Exception, context: str = "") -> Exception:
    """The error to raise for ``exc``, raised while building a plan: a user-input error as it
    is; a plain ValueError/TypeError (the strategies' checks of the model) as a SetupError
    (SetupTypeError) with the same message, prefixed by ``context``."""
    if isinstance(exc, UserInputError) or not isinstance(exc, (ValueError, TypeError)):
        return exc
    cls = SetupTypeError if isinstance(exc, TypeError) else SetupError
    text = " ".join(str(exc).split()) or type(exc).__name__
    return cls(f"{context}: {text}" if context else text)
