"""Domain (spatial) parallelism: halo exchange over a Cartesian grid of ranks.

decomposition.py is pure arithmetic; halo.py the exchange and its adjoint; layers.py and
convert.py the domain-parallel layers; functional.py the ops the forward calls itself (made
exact on tiles or refused); executor.py the ``domain`` transform (``prepare``: the model
made domain parallel and its ``DomainExecutor``); options.py the [domain] config table.
Names load on first use, so ``options`` imports no torch.
"""

import importlib

__all__ = ["DomainGrid", "halo_exchange", "make_plan", "split_bounds", "to_domain"]

_HOME = {"DomainGrid": "halo", "halo_exchange": "halo", "make_plan": "halo",
         "split_bounds": "decomposition", "to_domain": "convert"}


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
