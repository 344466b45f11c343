"""Bytes behind tensors, each storage counted once: what the memory reports measure."""

from __future__ import annotations

__all__ = ["nbytes"]


def nbytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (views of one buffer counted once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.nbytes():
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
