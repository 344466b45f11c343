"""Pipeline parallel: stages over the mesh's pp dimension, GPipe / 1F1B / interleaved 1F1B.

``prepare(layer_stack, world, PipelineOptions)`` (transform.py: the stage split, this rank's
stages built) is the one public entry (the orchestrator applies the dp flavour to the stage it
returns); executor.py runs the step through the schedule; the schedules (``schedule``) and the stage split (``plan``) are pure and testable without MPI.
Names load on first use, so ``options`` (the [pipeline] config table) imports no torch.
"""

import importlib

__all__ = ["PipelineOptions", "PipelineExecutor", "Probe", "check_fits", "prepare",
           "resolve_layout"]

_HOME = {"PipelineOptions": "options", "PipelineExecutor": "executor", "Probe": "transform",
         "prepare": "transform", "resolve_layout": "transform", "check_fits": "plan"}


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
