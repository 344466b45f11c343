"""``hpctrain.Trainer``: the Python entry for people who bring their own model and data.

Lightning users write ``Trainer(strategy=...).fit(model, dataloader)``; hpctrain takes the
same shape, over its plans and with its guarantee (the same trajectory as one process)::

    trainer = hpctrain.Trainer(strategy="zero3", steps=200, lr=1e-3, global_batch_size=64)
    summary = trainer.fit(model, DataLoader(dataset, batch_size=64, collate_fn=...),
                          loss_fn=loss_fn)

or the whole run from a config: ``hpctrain.Trainer(load_config("run.toml")).fit()``.

What a DataLoader means here (hpctrain/data/loader.py reads it):

* A map-style dataset: its items and ``collate_fn`` are used; its ``batch_size`` is the
  GLOBAL batch (what one process would train on per step) unless ``global_batch_size`` is
  given; its sampler (``shuffle``) is not: the order of samples comes from the run's seed
  (a partial last batch of an epoch is dropped), and each data-parallel rank collates only
  its part of every global batch, so the losses do not depend on the world size. With
  ``num_workers`` > 0 that part is read in worker processes set up as the loader's
  (``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``,
  ``worker_init_fn``, ``multiprocessing_context``, ``timeout``), prefetching across steps.
* An ``IterableDataset``: what one process training on this DataLoader would see. Every
  rank iterates the loader itself (its workers, its ``collate_fn``); each batch it yields
  is one global batch (its ``batch_size``; ``global_batch_size``, if given, must be the
  same), of which each rank keeps its rows of each micro-batch. A batch shorter than
  ``batch_size`` (a pass's last; with workers, each worker's last) is dropped, as with
  ``drop_last``; when the stream ends a new pass (epoch) starts. ``epochs=`` needs
  ``len(dataset)`` (a pass counts ``len // batch_size`` steps). A resumed run at step s
  reads the stream again from its start and drops the first s batches. Every rank reads
  the whole stream, so this suits streams that are cheap to read; map-style data is the
  path that scales (each rank reads only its part).

``batch_size=None`` (a dataset whose items are batches) is refused: the global batch must
be known. Validation (``val_dataloaders``, every ``val_every`` steps, or ``validate()``)
is the mean loss over the whole validation set (every sample, short batches too), each
rank forwarding every ranks-th sample of each batch, reduced over the ranks.
"""

from __future__ import annotations

from dataclasses import fields

from hpctrain.config import Config, ConfigError, load_config, parse_assignment

__all__ = ["Trainer", "Callback"]

# keyword -> dotted config key (the common ones; anything else through ``set``)
_KEYS = {
    "strategy": "train.strategy", "steps": "train.steps", "lr": "train.lr",
    "optimizer": "train.optimizer", "weight_decay": "train.weight_decay",
    "momentum": "train.momentum", "seed": "train.seed", "precision": "train.precision",
    "grad_accum": "train.grad_accum", "global_batch_size": "train.global_batch_size",
    "max_grad_norm": "train.max_grad_norm", "out_dir": "train.out_dir",
    "loss_weight": "train.loss_weight", "ignore_index": "train.ignore_index",
    "per_rank_dropout": "train.per_rank_dropout",
    "progress": "train.progress", "log_every": "train.log_every",
    "activation_checkpointing": "train.activation_checkpointing",
    "mesh": "runtime.mesh", "dp_flavour": "runtime.dp_flavour",
    "checkpoint_dir": "checkpoint.dir", "checkpoint_every": "checkpoint.every",
    "resume": "checkpoint.resume",
}


class Callback:
    """Hooks called on every rank, with metrics already reduced over the ranks (so every
    rank sees the same numbers and decides alike). Override what you need.

    ``trainer.should_stop = True`` from a hook ends training after that step (early
    stopping); the ranks agree on it before the next step."""

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        """After optimizer step ``step`` (1-based): metrics has loss, lr (the step's),
        units_per_s and grad_norm (None when nothing computed it)."""

    def on_validation_end(self, trainer, step: int, metrics: dict) -> None:
        """After the validation at step ``step`` (``val_every``): metrics has val_loss, the
        mean over the whole validation set (the same on every rank)."""

    def on_checkpoint(self, trainer, step: int, path: str) -> None:
        """After the checkpoint of step ``step`` was written to ``path``."""

    def on_fit_end(self, trainer, summary: dict) -> None:
        """After the last step (and its checkpoint); ``summary`` is what fit() returns."""


def _config(options: dict, settings) -> Config:
    """A Config from keyword options and ``set`` ("section.key=value" strings or a dict of
    dotted keys), through ``load_config`` (so values are checked as a TOML file's are);
    ConfigError naming a key it does not know."""
    overrides = []
    for key, value in options.items():
        if key not in _KEYS:
            raise ConfigError(f"Trainer({key}=...): unknown option; known: "
                              f"{', '.join(sorted(_KEYS))} (others: set={{'section.key': "
                              f"value}})")
        overrides.append(_nested(_KEYS[key], value))
    if isinstance(settings, dict):
        overrides += [_nested(k, v) for k, v in settings.items()]
    else:
        overrides += [parse_assignment(text) for text in settings or ()]
    return load_config(None, overrides)


def _nested(dotted: str, value) -> dict:
    """'train.model_options.layers', 2 -> {"train": {"model_options": {"layers": 2}}}."""
    section, _, key = dotted.partition(".")
    head, _, rest = key.partition(".")
    if not head:
        raise ConfigError(f"Trainer: {dotted!r} is not a config key (section.key)")
    return {section: {head: {rest: value} if rest else value}}


class Trainer:
    """See the module docstring. ``cfg``: a Config (the CLI's path); or keyword options
    (``strategy``, ``steps``, ``lr``, ``mesh``, ``dp_flavour``, ... and ``set`` for any
    other config key). ``callbacks``: Callback objects. ``force_unlock``: take over the
    run directories' lock another run left (README "Checkpoints": one run per directory)."""

    def __init__(self, cfg: Config | None = None, world=None, built=None, *, callbacks=(),
                 epochs: int | None = None, val_every: int = 0, set=None,  # noqa: A002
                 force_unlock: bool = False, checked=None, **options):
        if cfg is not None and (options or set):
            raise ConfigError("Trainer: give a Config or keyword options, not both")
        self.cfg = cfg if cfg is not None else _config(options, set)
        self.world, self.callbacks, self.epochs = world, list(callbacks), epochs
        if not isinstance(val_every, int) or val_every < 0:
            raise ConfigError(f"Trainer(val_every={val_every!r}): expected steps >= 0 (0: only "
                              f"at the end of fit)")
        self.val_every, self.force_unlock = val_every, force_unlock
        self.should_stop = False
        self.engine = None
        self._built = built  # None: fit() gets the model (or builds the config's)
        # train/checked.py's CheckedRun of cfg and ``built`` (the CLI checks before MPI)
        self._checked = checked
        self._ready = None  # the engine setup() built, which the next fit() trains

    def setup(self, model=None, train_dataloaders=None, val_dataloaders=None, loss_fn=None):
        """Build the model's plan and strategy, what fit() does before its first step, and
        keep it for the next fit() (called with no arguments). Collective.

        What the plan cannot run (a config value, a layer a strategy cannot split, a model
        that is not a chain for the pipeline) raises here, the same error on every rank: a
        ``hpctrain.errors.UserInputError`` (a ValueError; TypeError too where the model is
        of the wrong kind) whose message names the key or the layer and the fix."""
        self._ready = self._engine(model, train_dataloaders, val_dataloaders, loss_fn)
        return self

    def fit(self, model=None, train_dataloaders=None, val_dataloaders=None, loss_fn=None):
        """Train; return the run's summary (losses, throughput, ...). Collective.

        With no model: the config's model and data set (the CLI's run), or what setup()
        built. With a model: a torch.nn.Module (or a models.layers.LayerStack), a DataLoader
        of (input, target) batches (a map-style dataset or an IterableDataset: the module
        docstring), and ``loss_fn(output, target) -> mean loss``. Errors in what was given
        raise before the first step, as in setup()."""
        engine, self._ready = self._ready, None
        if engine is None or any(a is not None for a in (model, train_dataloaders,
                                                         val_dataloaders, loss_fn)):
            engine = self._engine(model, train_dataloaders, val_dataloaders, loss_fn)
        self.engine = engine
        validation = engine.validation
        try:
            summary = engine.fit()
        finally:
            if validation is not None:
                validation[0].close()  # its persistent workers
        for cb in self.callbacks:
            cb.on_fit_end(self, summary)
        return summary

    def _engine(self, model, train_dataloaders, val_dataloaders, loss_fn):
        """The engine (train/training_run.py) of fit()'s arguments, its plan and strategy built."""
        from hpctrain.train.training_run import TrainingRun

        if callable(val_dataloaders) and not hasattr(val_dataloaders, "__iter__"):
            raise ConfigError("Trainer.fit(model, train_dataloaders, val_dataloaders=None, "
                              "loss_fn=None): the third argument is the validation data (as "
                              "in Lightning); pass the loss as loss_fn=...")
        built, checked = self._built, self._checked
        if model is not None:
            built, checked = self._user_model(model, train_dataloaders, loss_fn), None
        elif train_dataloaders is not None or loss_fn is not None:
            raise ConfigError("Trainer.fit: data or a loss without a model; pass the model too")
        validation = None
        if val_dataloaders is not None:
            if built is None:
                raise ConfigError("Trainer.fit(val_dataloaders=...) needs the model and its "
                                  "loss_fn")
            every = self.val_every or self.cfg.train.steps  # 0: once, after the last step
            validation = (self._val_data(val_dataloaders), None, built.loss_fn, every)
        try:
            engine = TrainingRun(self.cfg, self.world, built, callbacks=self.callbacks,
                            owner=self, validation=validation, force_unlock=self.force_unlock,
                            checked=checked)
        except BaseException:
            if validation is not None:
                validation[0].close()
            raise
        self.world = engine.world
        return engine

    def validate(self, val_dataloaders, loss_fn=None) -> dict:
        """The mean loss over the whole validation set with the model as trained by the last
        fit(): {"val_loss": ...}, the same on every rank and at every world size under the
        plans (the pipeline, tensor and domain ones through their forward-only path).
        Collective."""
        if self.engine is None:
            raise ConfigError("Trainer.validate: call fit() first (it builds the model's plan)")
        source = self._val_data(val_dataloaders)
        try:
            loss = self.engine.evaluate(source, None, loss_fn or self.engine.built.loss_fn)
        finally:
            source.close()
        return {"val_loss": loss}

    def _val_data(self, loader):
        """The validation source of a DataLoader (data/loader.py)."""
        from torch.utils.data import DataLoader

        from hpctrain.data.loader import validation_source

        if not isinstance(loader, DataLoader):
            raise ConfigError(f"Trainer: validation data must be a torch DataLoader, got "
                              f"{type(loader).__name__}")
        return validation_source(loader, _batch_size(loader))

    def _user_model(self, model, loader, loss_fn):
        """BuiltModel of a user's model, DataLoader and loss (the global batch, the step
        count for ``epochs``); ConfigError for what cannot train the same as one process."""
        from torch.utils.data import DataLoader, IterableDataset

        from hpctrain.data.sampler import CollatedDataset
        from hpctrain.models.registry import BuiltModel, detect_unit

        if not isinstance(loader, DataLoader):
            raise ConfigError(f"Trainer.fit(model, train_dataloaders): expected a torch "
                              f"DataLoader, got {type(loader).__name__}")
        if not callable(loss_fn):
            raise ConfigError("Trainer.fit: loss_fn(output, target) -> mean loss is required")
        t, size = self.cfg.train, _batch_size(loader)
        stream = isinstance(loader.dataset, IterableDataset)
        if "train.global_batch_size" not in self._given():
            t.global_batch_size = size  # the DataLoader's batch is the global one
        elif stream and t.global_batch_size != size:
            raise ConfigError(f"Trainer(global_batch_size={t.global_batch_size}): an "
                              f"IterableDataset's batches are the global batches, and its "
                              f"DataLoader makes {size}; leave global_batch_size out or make "
                              f"it the DataLoader's batch_size")
        dataset = (_stream_dataset(loader, size) if stream else
                   CollatedDataset(loader.dataset, loader.collate_fn, loader))
        if self.epochs is not None:
            t.steps = max(1, self.epochs * _length(loader.dataset) // t.global_batch_size)
        t.model = f"{type(model).__module__}.{type(model).__name__}"
        unit, per_sample = detect_unit(dataset)
        return BuiltModel(model, dataset, loss_fn, t.model, unit, per_sample)

    def _given(self) -> set:
        """Dotted keys that differ from the defaults (what the user set)."""
        default, out = Config(), set()
        for section in ("train", "runtime", "checkpoint"):
            a, b = getattr(self.cfg, section), getattr(default, section)
            out |= {f"{section}.{f.name}" for f in fields(a)
                    if getattr(a, f.name) != getattr(b, f.name)}
        return out


def _batch_size(loader) -> int:
    """The batch a DataLoader makes: its batch_size, or its torch BatchSampler's; ConfigError
    when its batches have no fixed size."""
    from torch.utils.data import BatchSampler

    if loader.batch_size:
        return loader.batch_size
    if isinstance(loader.batch_sampler, BatchSampler):
        return loader.batch_sampler.batch_size  # hpctrain orders the samples itself
    if loader.batch_sampler is not None:
        raise ConfigError(f"Trainer: the DataLoader's batch_sampler "
                          f"({type(loader.batch_sampler).__name__}) may make batches of any "
                          f"size, but the global batch is fixed and hpctrain orders the "
                          f"samples from the run's seed: give DataLoader(dataset, "
                          f"batch_size=N, collate_fn=...) with N the global batch")
    raise ConfigError("Trainer: the DataLoader has batch_size=None (its dataset's items would "
                      "be whole batches), so the global batch is unknown: give "
                      "DataLoader(dataset, batch_size=N) with N the global batch, items one "
                      "sample each")


def _stream_dataset(loader, size):
    """StreamDataset of an IterableDataset's DataLoader; ConfigError when its first batch
    is not a whole global batch."""
    from hpctrain.data.loader import StreamDataset

    try:
        dataset = StreamDataset(loader)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"Trainer.fit: {exc}") from None
    if len(dataset) != size:
        raise ConfigError(f"Trainer.fit: the DataLoader's first batch has {len(dataset)} rows, "
                          f"not its batch_size {size}: the stream must give whole global "
                          f"batches (a longer stream, or a collate_fn with one row per item)")
    return dataset


def _length(dataset) -> int:
    """len(dataset) for ``epochs``; ConfigError for a stream without one."""
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError(f"Trainer(epochs=...): an epoch needs len(dataset), and "
                          f"{type(dataset).__name__} has no __len__; give steps=N "
                          f"instead") from None
