"""The communicator of a rank outside a group (DistDL's null object): inactive, and every
operation raises, so a non-member is caught at its first call instead of hanging a group."""

from __future__ import annotations

from abc import update_abstractmethods

import torch

from hpctrain.runtime.comm.base import BLOCKING_OPS, NONBLOCKING_OPS, Communicator

__all__ = ["NullCommunicator"]


class NullCommunicator(Communicator):
    """The communicator of a rank outside a group: it is inactive and refuses to communicate."""

    rank = -1
    size = 0
    device = torch.device("cpu")
    is_active = False

    def __init__(self, backend: str = "none"):
        self.backend = backend

    def free(self) -> None:
        """Do nothing: a NullCommunicator holds no resources."""

    _free = free


def _not_member(name: str):
    def method(self, *args, **kwargs):
        raise RuntimeError(
            f"{name}() on a NullCommunicator: this rank is not a member of this communicator "
            "(it passed color=None to split); check comm.is_active before communicating")
    method.__name__ = name
    method.__doc__ = f"Raise RuntimeError: this rank is not a member, so it cannot {name}."
    return method


# Public methods and backend hooks alike raise on a NullCommunicator.
for _name in BLOCKING_OPS + NONBLOCKING_OPS + ("boxes_exchange",):
    setattr(NullCommunicator, _name, _not_member(_name))
    setattr(NullCommunicator, "_" + _name, _not_member(_name))
update_abstractmethods(NullCommunicator)
del _name
