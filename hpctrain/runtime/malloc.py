"""glibc malloc tuning for the ranks: freed multi-MB tensors go back to the OS at once.

glibc raises its mmap threshold after each large free (up to 32 MB), so later multi-MB
tensors come from the heap, where freed holes stay resident: sharded strategies that gather
and free units measured 1.12-1.93x their formula in peak RSS. A fixed threshold (e.g. 256 KB)
turns that off, but every multi-MB tensor is then a fresh mmap that page-faults on first
touch: `bench step` measured zero3 at 2 ranks 757 ms vs 261 ms per step (sys time 3x). So
the default leaves glibc alone (speed); HPCTRAIN_MMAP_THRESHOLD_KB=256 trades step time for
peak RSS close to the formulas. A user's own MALLOC_MMAP_THRESHOLD_ (read by glibc at
startup) is left in charge.
"""

from __future__ import annotations

import ctypes
import os
from typing import Mapping

from hpctrain.errors import EnvError

__all__ = ["ENV", "DEFAULT_KB", "mmap_threshold_kb", "release_free_heap", "tune_malloc"]

ENV = "HPCTRAIN_MMAP_THRESHOLD_KB"
DEFAULT_KB = 0  # see the docstring: speed over peak RSS unless asked
_M_MMAP_THRESHOLD = -3  # from glibc's malloc.h
_applied: int | None = None
_libc = None  # glibc, once tune_malloc fixed a threshold (release_free_heap trims then)


def mmap_threshold_kb(env: Mapping[str, str]) -> int:
    """The threshold to set in KB (0: none) from the environment; EnvError (a ValueError)
    when malformed."""
    if "MALLOC_MMAP_THRESHOLD_" in env:
        return 0
    raw = (env.get(ENV) or "").strip()
    if not raw:
        return DEFAULT_KB
    try:
        kb = int(raw)
    except ValueError:
        kb = -1
    if kb < 0:
        raise EnvError(f"{ENV}={env.get(ENV)!r}: expected an integer number of KB >= 0 (e.g. "
                       f"256; 0 or unset: leave glibc's dynamic threshold)")
    return kb


def tune_malloc(env: Mapping[str, str] | None = None) -> int:
    """Fix glibc's mmap threshold once per process (a local call); return the KB set (0: none)."""
    global _applied, _libc
    if _applied is not None:
        return _applied
    kb = mmap_threshold_kb(os.environ if env is None else env)
    _applied = 0
    if kb:
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc (macOS, musl): nothing to tune
            return 0
        if libc.mallopt(_M_MMAP_THRESHOLD, kb * 1024) == 1:
            _applied = kb
            _libc = libc
    return _applied


def release_free_heap() -> None:
    """Give the heap's free pages back to the OS (malloc_trim; tens of microseconds) when a
    fixed threshold asked for low peak RSS; otherwise do nothing.

    Tensors under the threshold (activations, small gradients) live in the heap, and
    freeing them leaves holes that stay resident until trimmed: 4-6 MB of the peak of a
    20M-param zero3 rank at 4 ranks."""
    if _libc is not None:
        _libc.malloc_trim(0)
