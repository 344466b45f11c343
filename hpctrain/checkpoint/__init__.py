"""Parallel HDF5 checkpoints: each rank writes its rows or flat elements of every global tensor.

Strategies describe tensors (``Parallelized.state_entries``); this package does I/O only and
never imports a strategy. See README "Checkpoints".
"""

from hpctrain.checkpoint.commit import clean_stale
from hpctrain.checkpoint.layout import Entry
from hpctrain.checkpoint.manager import latest, list_checkpoints
from hpctrain.checkpoint.reader import CheckpointError, Reader
from hpctrain.checkpoint.resume import resolve_resume
from hpctrain.checkpoint.state import (RunState, load_checkpoint, load_model_state,
                                       read_model_state, save_checkpoint)

__all__ = ["Entry", "CheckpointError", "Reader", "RunState", "save_checkpoint", "load_checkpoint",
           "load_model_state", "read_model_state", "latest", "list_checkpoints",
           "resolve_resume", "clean_stale"]
