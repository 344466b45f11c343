"""Bytes as people read them: one formatter for every report (decimal units, GB = 1e9, as
--memory-gb and the stall reports use)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float, digits: int = 1) -> str:
    """'8.0 MB', '12.0 kB', '64 B'; ``digits`` after the point above 1 kB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"
