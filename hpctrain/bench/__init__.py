"""Benchmarks (``python -m hpctrain bench ...``)."""
