"""Pipeline parallel: stages over the mesh's pp dimension, GPipe / 1F1B / interleaved 1F1B.

``prepare(layer_stack, world, PipelineOptions)`` is the one public entry (the orchestrator
applies the dp flavour to the stage it returns); the
schedules (``schedule``) and the stage split (``plan``) are pure and testable without MPI.
"""

from hpctrain.parallel.pipeline.plan import check_fits
from hpctrain.parallel.pipeline.strategy import PipelineExecutor, PipelineOptions, prepare, \
    resolve_layout

__all__ = ["PipelineOptions", "PipelineExecutor", "check_fits", "prepare", "resolve_layout"]
