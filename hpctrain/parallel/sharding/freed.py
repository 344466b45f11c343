"""state_dict()/load_state_dict() refused on modules whose on-demand units are freed."""

from __future__ import annotations

from functools import partial

from torch import nn

__all__ = ["guard_freed_params"]


def guard_freed_params(model: nn.Module, units: list) -> None:
    """Make state_dict()/load_state_dict() of any module holding on-demand unit parameters
    raise while those are freed (their storage is released: reading it would crash)."""
    unit_of = {id(s.param): u for u in units for s in u.slots}
    for m in model.modules():
        mine = list({id(unit_of[id(p)]): unit_of[id(p)] for p in m.parameters()
                     if id(p) in unit_of}.values())
        if mine:
            m.register_state_dict_pre_hook(partial(_refuse_state_dict, mine))
            m.register_load_state_dict_pre_hook(partial(_refuse_load_state_dict, mine))


_FREED = ("the model's parameters are sharded (zero3 / fsdp FULL_SHARD, SHARD_GRAD_OP, "
          "HYBRID_SHARD): between steps each rank holds only its shard and the full tensors are "
          "freed")


def _refuse_state_dict(units, module, prefix, keep_vars) -> None:
    if not keep_vars and not all(u.gathered for u in units):
        raise RuntimeError(f"state_dict() called on a sharded model: {_FREED}; call "
                           f"par.full_state_dict() on every rank (collective; rank0_only=True "
                           f"returns it on rank 0 only) for the consolidated state")


def _refuse_load_state_dict(units, module, state_dict, prefix, *args) -> None:
    if not all(u.gathered for u in units):
        raise RuntimeError(f"load_state_dict() called on a sharded model: {_FREED}; load the "
                           f"state into the model before parallelize(), or resume from an "
                           f"hpctrain checkpoint")
