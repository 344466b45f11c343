"""The engine behind the sharded strategies (zero1/2/3, fsdp): not a strategy itself.

``engine.ShardedModel`` owns gradient reduction, the sharded step, norms, checkpoints and
the memory report; ``schedule.GatherSchedule`` gathers and frees units around their forward
and backward (with backward prefetch), in one canonical stream every rank walks in full, so
ranks whose graphs differ (a branch taken on some ranks only) still pair their collectives.
Strategies configure them and never import each other.
"""
