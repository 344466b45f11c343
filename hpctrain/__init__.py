"""hpctrain: train PyTorch models on supercomputers, launched the HPC way.

Python API for users who keep their own loop::

    import hpctrain
    world = hpctrain.init()                       # MPI ranks, nodes, device of this rank
    par = hpctrain.parallelize(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), strategy="ddp")
    loss = loss_fn(par.model(x), y) * (len(x) / global_batch)   # this rank's share
    par.backward(loss); par.step()

or the whole loop: ``hpctrain.Trainer(strategy="zero3", steps=100).fit(model, loader, loss_fn)``
(train/api.py), or from a config: ``hpctrain.Trainer(hpctrain.load_config("run.toml")).fit()``.
"""

from __future__ import annotations

from hpctrain.version import __version__

__all__ = ["__version__", "init", "parallelize", "load_config", "Config", "Trainer", "Callback"]


def init(ranks_per_node: int = 0, device: str = "auto"):
    """Initialise MPI and return the World of this process (collective over all ranks)."""
    from hpctrain.runtime.world import init_world

    return init_world(ranks_per_node=ranks_per_node, device=device)


def parallelize(model, optimizer, strategy: str = "ddp", world=None, options=None,
                mesh: str = "", dp_flavour: str = ""):
    """Wrap model and optimizer with a strategy; returns a Parallelized (collective).

    ``optimizer`` is either a factory ``params -> Optimizer`` (preferred: sharded strategies
    build it over their shard) or an optimizer instance, rebuilt with its class and defaults.
    ``strategy`` is one of ``parallel.STRATEGIES``: "zero1"/"zero2"/"zero3" run that
    stage (``options`` naming another stage is a ValueError); "pipeline" takes an
    nn.Sequential (one layer per child) or a LayerStack; "single" needs a one-rank world.
    ``mesh`` and ``dp_flavour`` compose, as on the command line: ``strategy="zero3",
    mesh="dom=2,dp=2"`` splits each sample over 2 ranks and shards over 2 replicas.
    See ``Parallelized`` for which of its methods are collective.
    """
    import torch

    from hpctrain import parallel

    if isinstance(optimizer, torch.optim.Optimizer):
        cls, defaults = type(optimizer), dict(optimizer.defaults)
        make = lambda params: cls(params, **defaults)  # noqa: E731
    elif callable(optimizer):
        make = optimizer
    else:
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable params -> "
                        f"Optimizer, got {type(optimizer).__name__}")
    return parallel.wrap(strategy, model, make, world or init(), options, mesh, dp_flavour)


def __getattr__(name):
    # Lazy: `import hpctrain` must stay cheap (no torch) for the CLI's config checks.
    if name in ("load_config", "Config"):
        from hpctrain import config

        return getattr(config, name)
    if name in ("Trainer", "Callback"):
        from hpctrain.train import api

        return getattr(api, name)
    raise AttributeError(f"module 'hpctrain' has no attribute {name!r}")
