"""Count the bytes autograd saves for backward (activations), excluding parameters.

One meter serves both sides of the planner: on the meta device it prices a model without
memory (``per_layer`` in model_shape.py), on real tensors it measures a run (bench/plan.py).
Saved tensors are counted once per storage (q, k and v are views of one qkv output), and the
peak of what is alive at once is kept: a saved tensor dies when its graph node is freed, so a
pipeline schedule's in-flight micro-batches and a recomputed block are counted as they live.
"""

from __future__ import annotations

import torch

__all__ = ["SavedTensorMeter"]


class _Held:
    """What the graph keeps instead of the tensor; its death releases the tensor's bytes."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    """``with meter: forward/backward`` -> ``meter.peak`` bytes saved and alive at once
    (``meter.total``: every distinct storage saved while active). ``params``: a callable
    giving the tensors never to count (the model's parameters, read at each save because
    sharded strategies swap their storages)."""

    def __init__(self, params=lambda: ()):
        self._params = params
        self._refs: dict = {}
        self._bytes: dict = {}
        self.seen: dict = {}  # every storage saved while active -> bytes
        self._keep: dict = {}  # meta tensors have no address: hold their bases to key by id
        self.live = self.peak = self.total = 0
        self._hooks = None

    @staticmethod
    def _key(t: torch.Tensor):
        if t.device.type == "meta":
            base = t._base if t._base is not None else t
            return ("meta", id(base)), base, base.numel() * base.element_size()
        storage = t.untyped_storage()
        return storage.data_ptr(), None, storage.nbytes()

    def _pack(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        key, base, nbytes = self._key(t)
        if any(self._key(p)[0] == key for p in self._params()):
            return t
        if self._refs.get(key, 0) == 0:
            self._bytes[key] = nbytes
            self.live += nbytes
            self.total += nbytes
            self.seen[key] = nbytes
            self.peak = max(self.peak, self.live)
            if base is not None:
                self._keep[key] = base
        self._refs[key] = self._refs.get(key, 0) + 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key):
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.live -= self._bytes.pop(key)
            self._keep.pop(key, None)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
