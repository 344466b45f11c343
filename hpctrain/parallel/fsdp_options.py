"""[fsdp]: the options of fully sharded data parallel (pure: the config table itself)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.option import given, option
from hpctrain.parallel.unit_policy import UnitPolicy, check_bucket_size, check_wrap_policy

__all__ = ["FSDPOptions", "SHARDING_STRATEGIES", "BACKWARD_PREFETCH", "DTYPE_NAMES",
           "DEFAULT_ALLGATHER_BUCKET_BYTES"]

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "NONE")
DTYPE_NAMES = ("", "fp32", "bf16", "fp16")  # '': keep the parameters' own
#: allgather_bucket_size's default: every unit up to 1 GiB is prefetched.
DEFAULT_ALLGATHER_BUCKET_BYTES = 1 << 30


@dataclass
class FSDPOptions(UnitPolicy):
    """Sharding strategy, the units' policy (UnitPolicy), prefetch, mixed precision and
    offload.

    ``allgather_bucket_size`` (bytes, as DeepSpeed's) bounds the parameters gathered ahead
    of their use: BACKWARD_PRE prefetches the next unit only when its full buffer fits (one
    unit ahead at a time), so a smaller bucket trades overlap for memory."""

    sharding_strategy: str = option("FULL_SHARD", "FULL_SHARD (zero3 per unit), SHARD_GRAD_OP, "
                                    "NO_SHARD (replicas) or HYBRID_SHARD (shard in node, "
                                    "replicate across)", choices=SHARDING_STRATEGIES)
    backward_prefetch: str = option("BACKWARD_PRE", "gather the next unit before this unit's "
                                    "backward (BACKWARD_PRE) or not (NONE)",
                                    choices=BACKWARD_PREFETCH)
    param_dtype: str = option("", "dtype of gathered params the model computes with ('': keep "
                              "fp32)", choices=DTYPE_NAMES)
    reduce_dtype: str = option("", "dtype gradients are reduced in ('': the param dtype)",
                               choices=DTYPE_NAMES)
    buffer_dtype: str = option("", "dtype of floating buffers ('': keep)", choices=DTYPE_NAMES)
    cpu_offload: bool = option(False, "keep shards, their grads and optimizer state on the host "
                               "(GPU)")
    sync_batchnorm: bool = option(True, "BatchNorm statistics over the global batch (all "
                                  "ranks)")
    allgather_bucket_size: int = option(DEFAULT_ALLGATHER_BUCKET_BYTES, "bytes: BACKWARD_PRE "
                                        "gathers the next unit ahead only when its full buffer "
                                        "fits this", min=1)
    grad_accum: int = given(1, "micro-batches per optimizer step (train.grad_accum)")

    def __post_init__(self):
        def check(field, value, allowed):
            if value not in allowed:
                raise ValueError(f"FSDPOptions.{field} = {value!r}: expected one of "
                                 f"{', '.join(repr(a) for a in allowed)}")
        check("sharding_strategy", self.sharding_strategy, SHARDING_STRATEGIES)
        check("backward_prefetch", self.backward_prefetch, BACKWARD_PREFETCH)
        for f in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            check(f, getattr(self, f), DTYPE_NAMES)
        check_wrap_policy("FSDPOptions", "fsdp", self.auto_wrap_policy, self.wrap_classes,
                          self.min_params)
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"FSDPOptions.grad_accum = {self.grad_accum!r}: expected an int >= 1 "
                             "(the number of backward calls per step)")
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            check_bucket_size("FSDPOptions", "fsdp", key, getattr(self, key))

    def check(self, cfg, plan) -> None:
        """The config's rules for a plan that reads [fsdp]."""
        if not plan.uses("pipeline"):
            self.check_policy("fsdp")
