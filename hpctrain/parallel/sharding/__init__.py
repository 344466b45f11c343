"""The engine behind the sharded strategies (zero1/2/3, fsdp): not a strategy itself.

``engine.ShardedModel`` ties the parts together and runs the sharded step: gradient
reduction (``grad_sync``, over ``reduction``'s non-blocking pieces), the ranks' agreement at
the step (``agreement``), norms and the non-finite path (``norms``), checkpoints (``state``)
and the memory report (``memory``), each unit's bookkeeping in ``unit_state``.
``schedule.GatherSchedule`` gathers and frees units around their forward and backward (with
backward prefetch), in one canonical stream every rank walks in full, so ranks whose graphs
differ (a branch taken on some ranks only) still pair their collectives. Strategies configure
them and never import each other.
"""
