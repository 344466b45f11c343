"""Pipeline parallel: stages over the mesh's pp dimension, GPipe / 1F1B / interleaved 1F1B.

``wrap(layer_stack, make_optimizer, world, PipelineOptions)`` is the one public entry; the
schedules (``schedule``) and the stage split (``plan``) are pure and testable without MPI.
"""

from hpctrain.parallel.pipeline.plan import check_fits
from hpctrain.parallel.pipeline.strategy import PipelineOptions, Pipelined, resolve_layout, wrap

__all__ = ["PipelineOptions", "Pipelined", "check_fits", "resolve_layout", "wrap"]
