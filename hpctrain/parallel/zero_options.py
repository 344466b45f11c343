"""[zero]: the options of ZeRO stages 1-3 (pure: the config table itself)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.option import given, option
from hpctrain.parallel.unit_policy import UnitPolicy, check_bucket_size, check_wrap_policy

__all__ = ["ZeroOptions"]


@dataclass
class ZeroOptions(UnitPolicy):
    """ZeRO stage (1: optimizer state, 2: + gradients, 3: + parameters sharded; None: taken
    from the strategy name by ``zero.options_for``), micro-batches per step, whether
    BatchNorm layers use global-batch statistics, and the units' policy (UnitPolicy). Stage 1
    reduces at the step, in place; stages 2 and 3 during backward, in reduce_bucket_size
    pieces."""

    sync_batchnorm: bool = option(True, "BatchNorm statistics over the global batch (all "
                                  "ranks)")
    stage: int | None = given(None, "the ZeRO stage (the flavour's: zero1, zero2, zero3)")
    grad_accum: int = given(1, "micro-batches per optimizer step (train.grad_accum)")

    def __post_init__(self):
        if self.stage not in (None, 1, 2, 3):
            raise ValueError(f"ZeroOptions.stage = {self.stage!r}: expected 1, 2 or 3 "
                             "(strategies zero1, zero2, zero3)")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"ZeroOptions.grad_accum = {self.grad_accum!r}: expected an int >= 1 "
                             "(the number of backward calls per step)")
        check_wrap_policy("ZeroOptions", "zero", self.auto_wrap_policy, self.wrap_classes,
                          self.min_params)
        check_bucket_size("ZeroOptions", "zero", "reduce_bucket_size", self.reduce_bucket_size)

    def check(self, cfg, plan) -> None:
        """The config's rules for a plan that reads [zero]."""
        if not plan.uses("pipeline"):
            self.check_policy("zero")
