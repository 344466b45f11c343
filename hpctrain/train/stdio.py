"""After SIGTERM a rank's stdout/stderr never stall it: what nobody reads is dropped.

Open MPI's mpirun (4.x), on SIGTERM, sends the ranks SIGCONT, sleeps
``odls_base_sigkill_timeout`` seconds, sends SIGTERM, sleeps as long again, then SIGKILL.
Asleep, it reads none of the ranks' output, so a rank that prints (``--log-every 1``) fills
its stdout pty (some 15 KB) and blocks in ``write()``; the others wait for it in the next
collective. The SIGTERM that follows only interrupts that write, which Python then retries
(PEP 475) and blocks again: the stop step is never reached, and SIGKILL ends the job without
its checkpoint.

So while the pre-emption handlers are installed, ``sys.stdout``/``sys.stderr`` go through a
thin proxy, and on SIGTERM each of fds 1 and 2 that can block (a pipe or a terminal) is
replaced by a non-blocking open of the same pipe or pty: a file description of its own, so
the launcher's and a shell's stay as they were. The interrupted write is retried on it; a
full fd (EAGAIN, or not writable when asked first) or one whose reader is gone (EPIPE) is
pointed at /dev/null for the rest of the process instead of waiting for a reader that may
come back only after SIGKILL. Before SIGTERM nothing changes; after it the process is
stopping, and the streams stay so until it exits.
"""

from __future__ import annotations

import os
import select
import stat
import sys

__all__ = ["UnstalledOutput"]

_UNREAD = (BlockingIOError, BrokenPipeError)


def _writable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & select.POLLOUT for _, ev in poller.poll(0))


class _Stream:
    """Forwards to the real text stream; once switched, a write that would block drops it."""

    def __init__(self, inner, fd: int, owner: "UnstalledOutput"):
        self._inner, self._fd, self._owner = inner, fd, owner

    def write(self, text):
        self._check()
        try:
            return self._inner.write(text)
        except _UNREAD:
            if not self._owner.switched:
                raise  # before SIGTERM: the stream's own behaviour, unchanged
            self._owner._drop(self._fd, self._inner)
            return len(text)

    def flush(self):
        self._check()
        try:
            self._inner.flush()
        except _UNREAD:
            if not self._owner.switched:
                raise
            self._owner._drop(self._fd, self._inner)

    def _check(self):
        # An unbuffered stream (python -u, PYTHONUNBUFFERED) loses what EAGAIN refuses
        # without a word: ask the fd first, so the drop is said and the last line rerouted.
        owner = self._owner
        if owner.switched and self._fd not in owner.dropped and not _writable(self._fd):
            owner._drop(self._fd, self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class UnstalledOutput:
    """The proxies on sys.stdout/sys.stderr (install/restore) and the switch made on SIGTERM."""

    def __init__(self):
        self.switched = False
        self.dropped: set[int] = set()
        self._saved: dict[str, object] = {}

    def install(self) -> "UnstalledOutput":
        for name, fd in (("stdout", 1), ("stderr", 2)):
            inner = getattr(sys, name)
            if inner is not None and not isinstance(inner, _Stream):
                self._saved[name] = inner
                setattr(sys, name, _Stream(inner, fd, self))
        return self

    def restore(self) -> None:
        """Put the streams back, unless SIGTERM switched them: then a later write (at exit
        too) could block again on a reader that is not there, so they stay until exit."""
        if self.switched:
            return
        for name, inner in self._saved.items():
            if isinstance(getattr(sys, name), _Stream):
                setattr(sys, name, inner)
        self._saved.clear()

    def switch(self) -> None:
        """On SIGTERM (in the handler, main thread): make fds 1 and 2 non-blocking."""
        if self.switched:
            return
        self.switched = True
        for fd in (1, 2):
            try:
                mode = os.fstat(fd).st_mode
                if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
                    continue  # a file never blocks; a socket cannot be reopened
                new = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            except OSError:
                continue  # this stream stays blocking
            os.dup2(new, fd)
            os.close(new)

    def _drop(self, fd: int, inner) -> None:
        """``fd`` takes no more: /dev/null from now on, the unsent rest of its stream too."""
        if fd in self.dropped:
            return
        self.dropped.add(fd)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        try:
            inner.flush()
        except (OSError, ValueError):
            pass
        if 2 not in self.dropped:
            try:
                os.write(2, (f"hpctrain: after SIGTERM nobody reads this rank's "
                             f"{'stdout' if fd == 1 else 'stderr'} (mpirun reads none while "
                             f"it waits odls_base_sigkill_timeout); dropping it rather than "
                             f"stalling before the checkpoint\n").encode())
            except OSError:
                pass
