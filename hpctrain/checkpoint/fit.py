"""Whether a checkpoint fits the model: checked on every rank before any strategy reads it.

Each strategy's loader reads only its own part of each tensor: a checkpoint of another model
size failed inside a sharded loader (a torch error on some ranks, an MPI abort), and a
checkpoint with tensors the model lacks loaded without a word. The strategy's checkpoint
entries (``state_entries``: every rank describes every tensor of the whole model, named and
shaped as under every other strategy) are what the file must hold, so the file is compared
with them first and every rank refuses it together.
"""

from __future__ import annotations

__all__ = ["fit_problems"]

_CONFIG = "resume with the config the checkpoint was written with"


def fit_problems(reader, entries) -> list[str]:
    """What in reader's file does not fit the model that ``entries`` describe; local.

    Model tensors: each entry's dataset present with the entry's global shape, and no other
    ``model/`` dataset. Optimizer state (``optim/<param>/<key>``): of a parameter of the model,
    of that parameter's shape or a scalar (Adam's step).
    """
    shapes = {n: tuple(reader.f[n].shape) for n in reader.names()}
    model = {e.name: tuple(e.shape) for e in entries if e.name.startswith("model/")}
    out = []
    for name, want in model.items():
        got = shapes.get(name)
        if got is None:
            out.append(f"dataset {name!r} is missing (a tensor of the model); {_CONFIG}")
        elif got != want:
            out.append(f"dataset {name!r} has shape {got}, the model expects {want}; {_CONFIG}")
    for name, got in shapes.items():
        if name.startswith("model/") and name not in model:
            out.append(f"dataset {name!r} is not a tensor of the model; {_CONFIG}")
        elif name.startswith("optim/") and name.count("/") >= 2:
            param = name[len("optim/"):].rsplit("/", 1)[0]
            want = model.get(f"model/{param}")
            if want is None:
                out.append(f"dataset {name!r} is optimizer state of {param!r}, not a parameter "
                           f"of the model; {_CONFIG}")
            elif got not in ((), want):
                out.append(f"dataset {name!r} has shape {got}, parameter {param!r} has {want}; "
                           f"{_CONFIG}")
    return out
