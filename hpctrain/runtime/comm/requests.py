"""Handles of non-blocking operations: what ``Communicator``'s ``i`` calls return.

A backend returns its own ``Request`` subclass; the ones here are shared by every backend:
a request finished when made, a started collective with its result tensor, several
requests completed together, a packed receive unpacked on completion, and ``wait_all``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hpctrain.runtime.comm.idle import wait_idle

__all__ = ["AllRequests", "CollectiveRequest", "CompletedRequest", "Request", "UnpackRequest",
           "wait_all"]


class Request(ABC):
    """Handle of a non-blocking operation."""

    @abstractmethod
    def wait(self) -> None:
        """Block until the operation completes."""

    @abstractmethod
    def test(self) -> bool:
        """Return True if the operation has completed, without blocking."""


class CompletedRequest(Request):
    """A request that was finished when it was made (local copies, size-1 fast paths).

    ``out`` is the result tensor of a non-blocking collective (None otherwise); ``wait()``
    returns it, as :class:`CollectiveRequest` does."""

    def __init__(self, out: torch.Tensor | None = None):
        self.out = out

    def wait(self) -> torch.Tensor | None:
        """Return ``out`` at once: there is nothing to wait for."""
        return self.out

    def test(self) -> bool:
        """Return True: the operation is already complete."""
        return True


class CollectiveRequest(Request):
    """A started non-blocking collective (``iallreduce``, ``iallgather``, ``ireduce_scatter``).

    ``out`` is the tensor the result lands in (the input itself for ``iallreduce``); it is
    valid only once the request is complete: after ``wait()`` (which returns ``out``) or a
    ``test()`` that returned True. ``finish`` runs once on completion, before ``out`` is
    valid: the backend's copy back from a staging buffer, the division of an average.
    ``keep`` holds what the backend reads or writes (numpy views, staging buffers) until then.
    """

    def __init__(self, request: Request, out: torch.Tensor | None = None, finish=None,
                 keep=None):
        self.out = out
        self._request, self._finish, self._keep = request, finish, keep
        self._done = False

    def wait(self) -> torch.Tensor | None:
        """Block until the collective completes (the backend's blocking wait, as the blocking
        collectives do; ``idle.wait_idle(req)`` or ``wait_all(reqs, idle=True)`` sleep
        between polls instead), then return ``out``."""
        if not self._done:
            self._request.wait()
            if self._finish is not None:
                self._finish()
            self._done, self._request, self._finish, self._keep = True, None, None, None
        return self.out

    def test(self) -> bool:
        """Return True (with ``out`` valid) if the collective has completed, without blocking."""
        if not self._done and self._request.test():
            self.wait()  # complete: finishes it without blocking
        return self._done


class AllRequests(Request):
    """Several requests completed together."""

    def __init__(self, requests: list):
        self._requests = requests

    def wait(self) -> None:
        """Block until every request has completed."""
        for r in self._requests:
            r.wait()
        self._requests = []

    def test(self) -> bool:
        """Return True if every request has completed, without blocking."""
        self._requests = [r for r in self._requests if not r.test()]
        return not self._requests


def wait_all(requests, idle: bool = False) -> list:
    """Wait for every request, in the order given, and return what each ``wait()`` returned
    (the ``out`` of a collective request, None for point-to-point ones). ``idle``: sleep
    between polls (``idle.wait_idle``) instead of the backend's blocking wait, so a waiting
    rank leaves its core to a computing one."""
    if idle:
        for r in requests:
            wait_idle(r)
    return [r.wait() for r in requests]


class UnpackRequest(Request):
    """A receive into a packed buffer that is copied out into the views once complete."""

    def __init__(self, request: Request, buffer: torch.Tensor, views: list):
        self._request, self._buffer, self._views = request, buffer, views

    def _unpack(self) -> None:
        if self._views is None:
            return
        start = 0
        for v in self._views:
            v.copy_(self._buffer[start:start + v.numel()].view(v.shape))
            start += v.numel()
        self._views = self._buffer = None

    def wait(self) -> None:
        """Block until the message has arrived, then fill the views."""
        self._request.wait()
        self._unpack()

    def test(self) -> bool:
        """Return True (and fill the views) if the message has arrived, without blocking."""
        done = self._request.test()
        if done:
            self._unpack()
        return done
