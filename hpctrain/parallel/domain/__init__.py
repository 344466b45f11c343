"""Domain (spatial) parallelism: halo exchange over a Cartesian grid of ranks.

decomposition.py is pure arithmetic; halo.py the exchange and its adjoint; layers.py and
convert.py the domain-parallel layers; functional.py the ops the forward calls itself (made
exact on tiles or refused); strategy.py the ``domain`` transform (``prepare``: the model
made domain parallel and its ``DomainExecutor``).
"""

from hpctrain.parallel.domain.decomposition import split_bounds
from hpctrain.parallel.domain.halo import DomainGrid, halo_exchange, make_plan
from hpctrain.parallel.domain.convert import to_domain

__all__ = ["DomainGrid", "halo_exchange", "make_plan", "split_bounds", "to_domain"]
