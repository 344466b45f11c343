"""One typed config: TOML file + CLI overrides, validated before any collective runs.

[train], [runtime] and [checkpoint] are declared here; each strategy's table is that
strategy's options class (registry.OPTIONS), whose field metadata carries the help, choices
and bounds, and whose ``check(cfg, plan)`` holds the table's own rules.

Validation is pure (no MPI): every rank reads the same file and flags, so every rank
fails the same way, with the same one-line message, before communication starts.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from typing import Any, Mapping

from hpctrain import registry
from hpctrain.errors import NONFINITE_EXIT_CODE, ConfigError
from hpctrain.option import names, option as _f

__all__ = [
    "ConfigError", "TrainSection", "RuntimeSection", "CheckpointSection", "Config",
    "load_config", "parse_assignment", "config_keys", "STRATEGIES", "BUILTIN_MODELS",
    "OPTIMIZERS", "PRECISIONS",
]

# models/registry.py BUILTIN: the same (kept here so `--help` and validation need no torch).
BUILTIN_MODELS = ("gpt", "mlp", "unet")
STRATEGIES = registry.STRATEGIES
DP_FLAVOURS = registry.FLAVOUR_NAMES
OPTIMIZERS = ("sgd", "adamw")  # the usual two; any torch.optim class is accepted
PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_WEIGHTS = ("samples", "tokens")
NONFINITE_MODES = ("stop", "skip", "ignore")  # train/nonfinite.py: what the guard does
PROGRESS = ("auto", "on", "off")
DEVICES = ("auto", "cpu", "cuda")



@dataclass
class TrainSection:
    """[train]: what to train and how."""

    model: str = _f("gpt", f"built-in model ({', '.join(BUILTIN_MODELS)}) or package.module:factory")
    strategy: str = _f("single", "parallel strategy", choices=STRATEGIES)
    steps: int = _f(200, "optimizer steps", min=1)
    global_batch_size: int = _f(32, "samples per optimizer step over all ranks", min=1)
    lr: float = _f(3e-3, "learning rate", min=0.0)
    optimizer: str = _f("adamw", "any torch.optim optimizer by name, any case (adamw, sgd, "
                        "Adagrad, RMSprop, ...), or a factory package.module:callable "
                        "(params, lr, **optimizer_options) -> Optimizer. zero1-3 and fsdp step "
                        "it on flat shards: elementwise optimizers are exact there; Adafactor "
                        "and Muon are refused, LBFGS and SparseAdam everywhere")
    optimizer_options: dict = _f(None, "keyword options of the optimizer "
                                 "([train.optimizer_options], e.g. betas = [0.9, 0.95]); they "
                                 "override weight_decay and momentum; lr is train.lr",
                                 default_factory=dict)
    weight_decay: float = _f(0.0, "weight decay (decoupled for adamw), for optimizers that "
                             "take it", min=0.0)
    momentum: float = _f(0.0, "momentum, for optimizers that take it (SGD, RMSprop)",
                         min=0.0, max=1.0)
    lr_schedule: str = _f("constant", "constant, warmup_cosine, or any "
                          "torch.optim.lr_scheduler class by name (StepLR, OneCycleLR, ...); "
                          "stepped once per optimizer step, also a non-finite step the guard "
                          "skipped (it counts toward train.steps)")
    lr_schedule_options: dict = _f(None, "keyword options of a torch.optim.lr_scheduler "
                                   "class ([train.lr_schedule_options], e.g. step_size = 10; "
                                   "OneCycleLR's total_steps and max_lr and CosineAnnealingLR's "
                                   "T_max default to train.steps and train.lr)",
                                   default_factory=dict)
    warmup_steps: int = _f(0, "warmup_cosine: linear warm-up steps from "
                           "warmup_start_factor x lr to lr", min=0)
    warmup_start_factor: float = _f(0.0, "warmup_cosine: the first step's lr as a fraction of "
                                    "lr", min=0.0, max=1.0)
    min_lr: float = _f(0.0, "warmup_cosine: the lr the cosine reaches at train.steps", min=0.0)
    seed: int = _f(0, "seed for weights, data order and data generation", min=0,
                   max=2 ** 63 - 1)
    precision: str = _f("fp32", "fp32, bf16 autocast, or fp16 autocast with loss scaling",
                        choices=PRECISIONS)
    grad_accum: int = _f(1, "micro-batches per optimizer step", min=1)
    activation_checkpointing: bool = _f(False, "recompute block activations in backward")
    deferred_init: bool = _f(True, "zero3, fsdp FULL_SHARD/HYBRID_SHARD and tensor parallel: build "
                             "the model on the meta device and fill only what each rank keeps "
                             "(built-in models; a user factory builds its model whole)")
    max_grad_norm: float = _f(0.0, "clip gradients to this global L2 norm (0: off)", min=0.0)
    loss_weight: str = _f("samples", "what the loss is a mean over: samples (each micro-batch "
                          "weighted by its samples) or tokens (by its target elements other "
                          "than ignore_index: exact for padded batches, whose samples hold "
                          "different numbers of tokens; one scalar all-reduce per step)",
                          choices=LOSS_WEIGHTS)
    ignore_index: int = _f(-100, "loss_weight = tokens: the target value that marks padding "
                           "(as torch's cross_entropy and Hugging Face labels)")
    per_rank_dropout: bool = _f(False, "tensor and pipeline plans: train a model with dropout "
                                "> 0 whose masks are not one process's (torch's dropout in a "
                                "split or piece-wise region); off: such a model is refused")
    nonfinite: str = _f("stop", f"a non-finite loss or gradient norm: stop (exit code "
                        f"{NONFINITE_EXIT_CODE}, no checkpoint from that state), skip (drop the "
                        f"step) or ignore", choices=NONFINITE_MODES)
    nonfinite_max_skips: int = _f(3, "nonfinite = skip: stop after this many skipped steps "
                                  "in a row", min=0)
    summary: str = _f("", "write a JSON summary here (rank 0)")
    out_dir: str = _f("hpctrain-out", "directory for metrics.csv, summary.json, report.png "
                      "and TensorBoard events (rank 0)")
    run_name: str = _f("", "write this run's files to out_dir/RUN_NAME/ instead of out_dir "
                       "itself ('auto': a timestamp and the plan name, e.g. 20261124-0712-zero3)")
    tensorboard: bool = _f(True, "write TensorBoard events (loss, lr, grad_norm, throughput, "
                           "peak RSS per step) next to metrics.csv, when the tensorboard "
                           "package imports")
    report: bool = _f(True, "draw out_dir/report.png at the end: loss, throughput, peak "
                      "memory per rank")
    trace_dir: str = _f("", "write a timeline (Chrome trace / Perfetto JSON, one row per rank: "
                        "phases, communication, pipeline actions) to DIR/trace.json")
    progress: str = _f("auto", "progress bar: auto (when a terminal), on, off", choices=PROGRESS)
    log_every: int = _f(10, "log a line every N steps when there is no progress bar", min=1)
    model_options: dict = _f(None, "keyword options for the model factory ([train.model_options])",
                             default_factory=dict)


@dataclass
class RuntimeSection:
    """[runtime]: the world, devices and the mesh."""

    mesh: str = _f("", "mesh degrees, e.g. 'dp=2,pp=2' or 'dp=2,dom=2' (empty: the strategy's "
                   "own: all ranks dp, pp or dom)")
    dp_flavour: str = _f("", "data-parallel flavour over the mesh's dp replicas: ddp, zero1, zero2, "
                         "zero3 or fsdp (empty: the strategy's)", choices=("",) + DP_FLAVOURS)
    ranks_per_node: int = _f(0, "pretend this many ranks per node (0: detect)", min=0)
    device: str = _f("auto", "device: auto (GPU by local rank if any), cpu, cuda", choices=DEVICES)
    collective_timeout_s: float = _f(600.0, "a communication op pending this long on a rank ends "
                                     "the job with a stall report (0: no watchdog)", min=0.0)
    flight_recorder: bool = _f(True, "record every communication op per rank (ring buffer; "
                               "the stall report and `trace flight` read it)")


@dataclass
class CheckpointSection:
    """[checkpoint]: parallel HDF5 checkpoints."""

    dir: str = _f("", "directory for ckpt-STEP.h5 files (empty: no checkpoints)")
    every: int = _f(0, "save every N steps (0: only at the end)", min=0)
    keep: int = _f(3, "keep the newest K checkpoints (0: keep all)", min=0)
    resume: str = _f("", "resume: '' (no), 'auto' (newest in dir, if any) or a ckpt file")
    requeue: str = _f("auto", "on SIGUSR1/SIGTERM checkpoint, then 'auto': scontrol requeue "
                      "the SLURM batch job; 'off': only exit with code 75", choices=("auto", "off"))
    sigterm_grace_s: float = _f(0.0, "seconds from SIGTERM to SIGKILL; a save that cannot "
                                "finish in them is not started (0: the launcher's: mpirun's "
                                "odls_base_sigkill_timeout, SLURM 30, PBS 10)", min=0.0)


class _Config:
    """The methods of Config (its fields, one per TOML table, are below)."""

    def validate(self, world_size: int = 1) -> "Config":
        """Check every field and the cross-field rules; raise ConfigError naming the key."""
        self.check(world_size)
        return self

    def check(self, world_size: int):
        """``validate``, returning the ParallelPlan it built (once) on the way."""
        for sname, section in self.sections().items():
            for f in config_keys(section):
                _check_field(f"{sname}.{f.name}", getattr(section, f.name), f)
        t = self.train
        plan = self.plan(world_size)
        self._validate_tables_used(plan)
        if t.grad_accum > t.global_batch_size:
            raise ConfigError(
                f"train.grad_accum = {t.grad_accum} is larger than train.global_batch_size = "
                f"{t.global_batch_size}: every micro-batch needs at least one sample; lower "
                f"--grad-accum or raise --global-batch-size")
        # Each table the plan reads checks its own rules (the options class's ``check``).
        for table in self.tables_read(plan):
            section = getattr(self, table)
            if hasattr(section, "check"):
                section.check(self, plan)
        per_micro = t.global_batch_size // t.grad_accum
        batch_ranks = plan.batch_ranks
        # (a pipeline's micro-batches split into its own pieces: its check says how)
        if not plan.uses("pipeline") and per_micro < batch_ranks:
            raise ConfigError(
                f"train.global_batch_size = {t.global_batch_size} with grad_accum = {t.grad_accum} "
                f"gives micro-batches of {per_micro} samples, fewer than the {batch_ranks} ranks "
                f"that split the batch; use --global-batch-size >= {t.grad_accum * batch_ranks}")
        if t.lr_schedule == "warmup_cosine":
            self._validate_warmup_cosine()
        elif t.lr_schedule == "constant" and t.lr_schedule_options:
            raise ConfigError("train.lr_schedule_options is set, but train.lr_schedule = "
                              "'constant' takes no options; drop the table or name a "
                              "schedule (--lr-schedule StepLR, ...)")
        if t.loss_weight == "tokens" and plan.domain:
            raise ConfigError("train.loss_weight = 'tokens' weights a loss by its valid target "
                              "elements; the domain split weights each tile by its share of the "
                              "grid (dense fields): use loss_weight = 'samples'")
        if t.run_name and not t.out_dir:
            raise ConfigError(f"train.run_name = {t.run_name!r} names a directory under "
                              f"train.out_dir, which is empty (nothing is written); give "
                              f"--out-dir DIR or drop --run-name")
        c = self.checkpoint
        if (c.every or c.resume == "auto") and not c.dir:
            raise ConfigError(
                f"checkpoint.every = {c.every} / checkpoint.resume = {c.resume!r} need a directory; "
                f"pass --checkpoint-dir DIR")
        rpn = self.runtime.ranks_per_node
        if rpn and world_size % rpn:
            raise ConfigError(f"runtime.ranks_per_node = {rpn}: the {world_size} ranks launched "
                              f"are not divisible by it; launch a multiple of {rpn} ranks or "
                              f"change --ranks-per-node")
        return plan

    def plan(self, world_size: int):
        """The ParallelPlan of this config at world_size (ConfigError if it cannot run)."""
        from hpctrain.parallel.plan import build_plan

        try:
            return build_plan(self.train.strategy, self.runtime.mesh, world_size,
                              self.runtime.dp_flavour, self.pipeline.dp_sharding)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def tables_read(self, plan) -> tuple:
        """The strategy option tables the plan reads (registry.tables_read)."""
        return registry.tables_read(plan)

    def _validate_tables_used(self, plan) -> None:
        """Refuse a changed option of a table the plan never reads (it would do nothing)."""
        used = self.tables_read(plan)
        for sname in registry.TABLES:
            if sname in used:
                continue
            section, default = getattr(self, sname), type(getattr(self, sname))()
            for f in config_keys(section):
                value = getattr(section, f.name)
                if value != getattr(default, f.name):
                    users = registry.strategies_reading(sname)
                    raise ConfigError(
                        f"{sname}.{f.name} = {_toml_form(value)!r} is set, but train.strategy = "
                        f"{self.train.strategy!r} (plan {plan.name}) does not read [{sname}] "
                        f"(used by {', '.join(users)}); drop the option or pick one of those "
                        f"strategies")

    def effective_mesh(self, world_size: int) -> str:
        """The mesh in use, as the plan resolves it (e.g. 'pp=2,dp=2,dom=1,tp=1')."""
        return self.plan(world_size).mesh_text()

    def _validate_warmup_cosine(self) -> None:
        t = self.train
        if t.warmup_steps > t.steps:
            raise ConfigError(f"train.warmup_steps = {t.warmup_steps} is more than train.steps "
                              f"= {t.steps}; use at most {t.steps}")
        if t.min_lr > t.lr:
            raise ConfigError(f"train.min_lr = {t.min_lr} is above train.lr = {t.lr}; the "
                              f"cosine decays from lr to min_lr: lower --set train.min_lr")
        if t.lr_schedule_options:
            raise ConfigError("train.lr_schedule_options is set, but warmup_cosine reads "
                              "train.warmup_steps, warmup_start_factor and min_lr; drop the table")

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Each table's keys in their TOML form (a tuple key: comma-separated names)."""
        return {name: {f.name: _toml_form(getattr(sec, f.name)) for f in config_keys(sec)}
                for name, sec in self.sections().items()}

    def to_toml(self) -> str:
        """Render as TOML text that load_config reads back to an equal Config."""
        lines: list[str] = []
        for name, values in self.to_dict().items():
            lines.append(f"[{name}]")
            tables = {}
            for key, value in values.items():
                if isinstance(value, dict):
                    tables[key] = value
                else:
                    lines.append(f"{key} = {_toml_value(value)}")
            for key, table in tables.items():
                lines.append(f"[{name}.{key}]")
                lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
            lines.append("")
        return "\n".join(lines)


def _table(name: str, cls: type):
    return name, cls, field(default_factory=cls)


#: The whole config: one dataclass per TOML table ([train], then each strategy's options
#: class, registry.OPTIONS, then [runtime] and [checkpoint]); ``cfg.pipeline`` is the
#: PipelineOptions the pipeline runs with.
Config = dataclasses.make_dataclass(
    "Config", [_table("train", TrainSection)]
    + [_table(name, registry.options_class(name)) for name in registry.OPTIONS]
    + [_table("runtime", RuntimeSection), _table("checkpoint", CheckpointSection)],
    bases=(_Config,), namespace={"__module__": __name__, "__doc__": "The whole config: one "
                                 "dataclass per TOML table (a strategy's table is its options "
                                 "class, registry.OPTIONS)."})


def config_keys(section) -> tuple:
    """The fields of a table that are config keys (an options class's fields the run fills
    in, ``option.given``, are not)."""
    return tuple(f for f in dataclasses.fields(section) if f.metadata.get("config", True))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} ({type(v).__name__}) to TOML")


def _toml_form(value: Any) -> Any:
    return ", ".join(value) if isinstance(value, tuple) else copy.deepcopy(value)


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "a table", tuple: "comma-separated names (a string)"}.get(tp, str(tp))


def _field_type(f: dataclasses.Field) -> type:
    # Annotations are strings under `from __future__ import annotations`.
    return {"int": int, "float": float, "bool": bool, "str": str, "dict": dict,
            "tuple": tuple}[f.type]


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    tp = _field_type(f)
    if tp is tuple and isinstance(value, str):  # a tuple key's TOML form
        value = names(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")
    if tp is not bool and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")
    return value


def _check_field(key: str, value: Any, f: dataclasses.Field) -> None:
    _coerce(key, value, f)
    meta = f.metadata
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r}: expected a finite number")
    if meta.get("choices") and value not in meta["choices"]:
        shown = ", ".join("'' (keep)" if c == "" else str(c) for c in meta["choices"])
        raise ConfigError(f"{key} = {value!r}: expected one of {shown}")
    if meta.get("min") is not None and value < meta["min"]:
        raise ConfigError(f"{key} = {value!r}: must be >= {meta['min']}")
    if meta.get("max") is not None and value > meta["max"]:
        raise ConfigError(f"{key} = {value!r}: must be <= {meta['max']}")


def _apply(cfg: Config, data: Mapping[str, Any], origin: str) -> None:
    sections = cfg.sections()
    for sname, values in data.items():
        if sname not in sections:
            raise ConfigError(f"{origin}: unknown table [{sname}]; valid tables: "
                              f"{', '.join(sections)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"{origin}: {sname} must be a table, got {values!r}")
        section = sections[sname]
        fields = {f.name: f for f in config_keys(section)}
        for key, value in values.items():
            if key not in fields:
                raise ConfigError(f"{origin}: unknown key {sname}.{key}; valid keys: "
                                  f"{', '.join(fields)}")
            value = _coerce(f"{sname}.{key}", value, fields[key])
            if isinstance(value, dict):
                # A table given later adds to (and overrides keys of) the earlier one.
                value = {**getattr(section, key), **value}
            setattr(section, key, value)


def parse_assignment(text: str) -> dict[str, Any]:
    """Parse 'section.key=value' (value in TOML syntax, bare words taken as strings).

    A longer dotted name sets one entry of a table: 'train.model_options.layers=2'.
    """
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. ddp.fp16_compression=true")
    lhs, rhs = text.split("=", 1)
    parts = [p.strip() for p in lhs.split(".")]
    if not all(parts):
        raise ConfigError(f"--set {text!r}: empty name in {lhs.strip()!r}; expected "
                          f"section.key=value or section.table.key=value")
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()  # a bare word such as adamw
    for name in reversed(parts[2:]):
        value = {name: value}
    return {parts[0]: {parts[1]: value}}


def load_config(path: str | None = None, overrides: list[Mapping[str, Any]] = ()) -> Config:
    """Build a Config from defaults, then a TOML file, then override mappings, in that order."""
    cfg = Config()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path!r} is a directory; pass a TOML file") from None
        except OSError as exc:
            raise ConfigError(f"config file {path!r} cannot be read ({exc.strerror or exc}); "
                              f"pass a readable TOML file") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {exc.start}), so "
                              f"not a TOML file; pass a TOML config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
        _apply(cfg, data, path)
    for ov in overrides:
        _apply(cfg, ov, "command line")
    return cfg
