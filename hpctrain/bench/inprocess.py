"""Running many command lines in one process: a stream that keeps a copy of what it passes on,
and a per-case environment (the GPU check's plans worker; the tests' train worker too)."""

from __future__ import annotations

import contextlib
import io
import os

__all__ = ["Tee", "patched_env"]


class Tee(io.TextIOBase):
    """Write to the real stream and keep a copy (``copy.getvalue()``)."""

    def __init__(self, real):
        self.real, self.copy = real, io.StringIO()

    def write(self, s):
        self.copy.write(s)
        return self.real.write(s)

    def flush(self):
        self.real.flush()


@contextlib.contextmanager
def patched_env(env: dict):
    """Set ``env`` in os.environ for the block, then put back what was there (in-process
    workers run many cases, each with its own variables)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
