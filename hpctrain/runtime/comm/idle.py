"""Waiting on a Request without holding a core.

A blocking MPI wait busy-polls: on a machine with fewer cores than ranks (or shared with
other jobs) the waiting rank then competes with a computing one for a core. ``wait_idle``
polls ``req.test()`` and sleeps in between. Linux pads every sleep by the thread's timer
slack (50 us by default), so the first call lowers this thread's slack to 1 us: a 10 us nap
then wakes within ~20 us, keeping the added latency per message far below a layer's compute.
"""

from __future__ import annotations

import ctypes
import sys
import time

__all__ = ["wait_idle", "set_timer_slack"]

_PR_SET_TIMERSLACK = 29
_slack_set = False


def set_timer_slack(ns: int = 1000) -> bool:
    """Lower this thread's timer slack to ``ns`` nanoseconds (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def wait_idle(req, first_nap: float = 10e-6, max_nap: float = 50e-6) -> None:
    """Complete ``req`` (anything with ``test() -> bool``), sleeping between polls; the nap
    grows from ``first_nap`` to ``max_nap`` so a long wait costs few wake-ups."""
    global _slack_set
    if req.test():
        return
    if not _slack_set:
        _slack_set = True
        set_timer_slack()
    nap = first_nap
    while not req.test():
        time.sleep(nap)
        nap = min(max_nap, nap * 1.5)
