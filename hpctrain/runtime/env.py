"""Read hpctrain's own environment variables strictly: a value we cannot read is an error.

A misspelt switch (``HPCTRAIN_CKPT_FORCE_SERIAL=maybe``) must not quietly count as on or off.
"""

from __future__ import annotations

import os
from typing import Mapping

from hpctrain.errors import EnvError

__all__ = ["env_flag", "TRUE_WORDS", "FALSE_WORDS"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def env_flag(name: str, env: Mapping[str, str] | None = None, default: bool = False) -> bool:
    """Return the boolean in ``env[name]`` (unset or empty: default); EnvError when unclear."""
    env = os.environ if env is None else env
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in TRUE_WORDS:
        return True
    if raw in FALSE_WORDS:
        return False
    raise EnvError(f"{name}={env[name]!r} is not a clear boolean; set it to one of "
                   f"{', '.join(TRUE_WORDS)} (on) or {', '.join(FALSE_WORDS)} (off), or unset it")
