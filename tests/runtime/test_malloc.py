"""glibc mmap-threshold tuning: parsed from the environment, applied once, user's own wins."""

import pytest

from hpctrain.runtime import malloc


def test_threshold_from_environment():
    assert malloc.mmap_threshold_kb({}) == malloc.DEFAULT_KB == 0  # glibc's own: speed
    assert malloc.mmap_threshold_kb({malloc.ENV: "512"}) == 512
    assert malloc.mmap_threshold_kb({malloc.ENV: "0"}) == 0  # leave glibc dynamic
    # The user's glibc tunable was applied by glibc at startup: do not override it.
    assert malloc.mmap_threshold_kb({"MALLOC_MMAP_THRESHOLD_": "131072"}) == 0
    for bad in ("lots", "-1"):
        with pytest.raises(ValueError, match=malloc.ENV):
            malloc.mmap_threshold_kb({malloc.ENV: bad})


def test_tune_malloc_applies_once(monkeypatch):
    monkeypatch.setattr(malloc, "_applied", None)
    assert malloc.tune_malloc({malloc.ENV: "256"}) == 256  # glibc on this Linux
    assert malloc.tune_malloc({malloc.ENV: "0"}) == 256  # once per process
