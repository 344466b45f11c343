"""A prepared point-to-point exchange of boxes: the messages of a halo exchange, checked once.

A halo exchange sends the same few messages every step. ``Communicator.boxes_exchange``
checks their peers, tags and boxes once; ``start(recv_into, send_from)`` then posts them all
with one call and returns one request. Per step that leaves a layout lookup and the posts:
the Python work around each message (checks, datatype lookup, request wrappers) had cost as
much as the wire time of a 256 KiB halo.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpctrain.runtime.comm.requests import AllRequests, Request

__all__ = ["BoxesExchange"]


def _check_messages(comm, messages, what: str) -> tuple:
    """((peer, tag, boxes), ...) with valid peers, tags and well-formed boxes."""
    out = []
    for msg in messages:
        if not isinstance(msg, Sequence) or len(msg) != 3:
            raise ValueError(f"a message is (peer, tag, boxes), got {msg!r}")
        peer, tag, boxes = msg
        comm._check_rank(peer, what)
        comm._check_tag(tag)
        if not isinstance(boxes, Sequence) or not boxes:
            raise ValueError(f"boxes must be a non-empty list of boxes, got {boxes!r}")
        boxes = tuple(tuple((int(lo), int(hi)) for lo, hi in box) for box in boxes)
        if any(lo > hi or lo < 0 for box in boxes for lo, hi in box):
            raise ValueError(f"boxes {boxes!r}: every range needs 0 <= start <= stop")
        out.append((peer, int(tag), boxes))
    return tuple(out)


class BoxesExchange:
    """Receives into boxes of one tensor and sends from boxes of another, prepared once.

    ``recvs`` and ``sends`` are ``(peer, tag, boxes)`` per message; a box is ``((start,
    stop), ...)`` over the trailing dims, as in ``Communicator.isend_boxes``. Each started
    exchange must be waited for before the next is started.
    """

    def __init__(self, comm, recvs: Sequence, sends: Sequence):
        self.comm = comm
        self.recvs = _check_messages(comm, recvs, "source")
        self.sends = _check_messages(comm, sends, "dest")
        self._fits: set = set()  # tensor layouts already checked against the boxes

    def start(self, recv_into: torch.Tensor | None, send_from: torch.Tensor | None) -> Request:
        """Post every receive (into ``recv_into``) and send (from ``send_from``) and return one
        request; keep both tensors alive, and the sent one unchanged, until its wait(), and
        wait before starting this exchange again."""
        return self._start(recv_into, send_from)

    def _check_fit(self, recv_into, send_from) -> None:
        """Raise unless both tensors fit the messages (once per layout: see _start)."""
        self._check(recv_into, self.recvs, "recv_into", "source")
        self._check(send_from, self.sends, "send_from", "dest")

    def _check(self, tensor, messages, what: str, peer_kind: str) -> None:
        if not messages:
            return
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor (this exchange has messages for it), "
                            f"got {type(tensor).__name__}")
        for peer, tag, boxes in messages:  # dtype, device, and every box inside the tensor
            self.comm._check_boxes(tensor, boxes, peer, peer_kind, tag)

    def _start(self, recv_into, send_from) -> Request:
        """Default: one isend/irecv of boxes per message (backends may do better)."""
        key = (_layout(recv_into), _layout(send_from))
        if key not in self._fits:
            self._check_fit(recv_into, send_from)
            if len(self._fits) < 64:
                self._fits.add(key)
        c = self.comm
        reqs = [c._irecv_boxes(recv_into.detach(), boxes, peer, tag)
                for peer, tag, boxes in self.recvs]
        reqs += [c._isend_boxes(send_from.detach(), boxes, peer, tag)
                 for peer, tag, boxes in self.sends]
        return AllRequests(reqs)


def _layout(t) -> tuple | None:
    return None if t is None else (t.shape, t.dtype, t.device)
