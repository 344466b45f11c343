"""``python -m hpctrain train``: its flags (each a config key, described by the config
field itself), the checks every rank runs before MPI starts, and the run."""

from __future__ import annotations

import argparse
import os
import sys

from hpctrain.config import ConfigError, _field_type, load_config, parse_assignment
from hpctrain.errors import NONFINITE_EXIT_CODE, UsageError, UserInputError

__all__ = ["TRAIN_FLAGS", "BOOL_FLAGS", "add_train_parser", "cmd_train", "positive_int"]


def positive_int(text: str, hint: str = "") -> int:
    """An argparse type: a positive integer, else the flag's error (with ``hint`` after it)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer{hint}")
    return value


def _ranks_per_node(text: str) -> int:
    """--ranks-per-node: a positive count; leaving the flag out detects the nodes."""
    return positive_int(text, " (ranks per node to pretend); leave the flag out to detect "
                              "the nodes")


SHARDED = "<zero or fsdp>"  # a flag for the table of the plan's sharded flavour


def _scalar(text: str):
    """A flag value as TOML reads it (an integer, a number, else the text), so that the
    config's check names the key when the type is wrong."""
    for tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            pass
    return text


# flag -> (section, key[, type]): the help and the type are the config field's own
# (config.py), so the flags and the TOML keys are described once.
TRAIN_FLAGS = {
    "strategy": ("train", "strategy"),
    "model": ("train", "model"),
    "steps": ("train", "steps"),
    "global_batch_size": ("train", "global_batch_size"),
    "lr": ("train", "lr"),
    "optimizer": ("train", "optimizer"),
    "lr_schedule": ("train", "lr_schedule"),
    "weight_decay": ("train", "weight_decay"),
    "seed": ("train", "seed"),
    "precision": ("train", "precision"),
    "grad_accum": ("train", "grad_accum"),
    "max_grad_norm": ("train", "max_grad_norm"),
    "loss_weight": ("train", "loss_weight"),
    "nonfinite": ("train", "nonfinite"),
    "summary": ("train", "summary"),
    "out_dir": ("train", "out_dir"),
    "run_name": ("train", "run_name"),
    "trace": ("train", "trace_dir"),
    "progress": ("train", "progress"),
    "log_every": ("train", "log_every"),
    "mesh": ("runtime", "mesh"),
    "dp_flavour": ("runtime", "dp_flavour"),
    "ranks_per_node": ("runtime", "ranks_per_node", _ranks_per_node),
    "device": ("runtime", "device"),
    "collective_timeout_s": ("runtime", "collective_timeout_s"),
    "checkpoint_dir": ("checkpoint", "dir"),
    "checkpoint_every": ("checkpoint", "every"),
    "keep": ("checkpoint", "keep"),
    "resume": ("checkpoint", "resume"),
    "requeue": ("checkpoint", "requeue"),
    "fusion_threshold_mb": ("ddp", "fusion_threshold_mb"),
    "sharding_strategy": ("fsdp", "sharding_strategy"),
    "auto_wrap_policy": ("fsdp", "auto_wrap_policy"),
    # [zero] or [fsdp], whichever the plan's dp flavour reads (_sharded_overrides)
    "reduce_bucket_size": (SHARDED, "reduce_bucket_size", _scalar),
    "allgather_bucket_size": ("fsdp", "allgather_bucket_size", _scalar),
}
BOOL_FLAGS = {
    "activation_checkpointing": ("train", "activation_checkpointing"),
    "fp16_compression": ("ddp", "fp16_compression"),
}


def _field(section: str, key: str):
    """The config field behind a flag (a SHARDED flag: [zero]'s, which [fsdp] shares)."""
    import dataclasses

    from hpctrain.config import Config

    holder = {f.name: f for f in dataclasses.fields(Config)}["zero" if section == SHARDED
                                                              else section].default_factory
    return next(f for f in dataclasses.fields(holder) if f.name == key)


def _flag_help(section: str, key: str) -> str:
    f = _field(section, key)
    where = "zero or fsdp" if section == SHARDED else section
    text = f.metadata["help"].replace("%", "%%")
    choices = f.metadata.get("choices")
    if choices and "," not in text:  # a help that lists them already is left alone
        text += ": " + ", ".join(c for c in choices if c)
    return f"{text} ({where}.{key})"


TRAIN_EPILOG = f"""exit codes: 0 trained; 1 an error while training (the message says which);
2 a bad flag, config, environment variable, launch or model for the plan, or an out or
checkpoint directory another run is using, found before the first step;
{NONFINITE_EXIT_CODE} a non-finite loss or gradient (train.nonfinite = stop, or skip past
train.nonfinite_max_skips; no checkpoint written from that state); 75 pre-empted
(checkpoint written, rerun to resume)."""


def add_train_parser(sub) -> None:
    """The ``train`` command and its flags on the CLI's subparsers."""
    t = sub.add_parser("train", help="train a model (default: gpt, single process)",
                       epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--config", metavar="FILE.toml", help="TOML config; flags override it")
    for name, (section, key, *tp) in TRAIN_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name,
                       type=tp[0] if tp else _field_type(_field(section, key)),
                       help=_flag_help(section, key))
    for name, (section, key) in BOOL_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true", default=None,
                       help=_flag_help(section, key))
    t.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set ddp.cycle_time_ms=2")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    t.add_argument("--force-unlock", action="store_true", help="take over the lock another "
                   "run left in the out/checkpoint directories (after a crash on another "
                   "host; nothing checks that the run has ended)")


def _overrides(args) -> list[dict]:
    out = [parse_assignment(a) for a in args.assignments]
    for name, (section, key, *_rest) in {**TRAIN_FLAGS, **BOOL_FLAGS}.items():
        value = getattr(args, name)
        if value is not None and section != SHARDED:
            out.append({section: {key: value}})
    return out


def _sharded_overrides(args, cfg, size: int) -> list[dict]:
    """The flags of the sharded flavour's table ([zero] for zero1-3, [fsdp] for fsdp),
    which the plan's dp flavour names; ConfigError for a plan without one."""
    from hpctrain import registry

    out = []
    for name, (section, key, *_rest) in TRAIN_FLAGS.items():
        value = getattr(args, name)
        if section != SHARDED or value is None:
            continue
        flavour = cfg.plan(size).flavour
        if flavour not in registry.SHARDED_FLAVOURS:
            raise ConfigError(f"--{name.replace('_', '-')} {value} sizes the gradient reduction "
                              f"of zero1-3 and fsdp, but the plan's dp flavour is {flavour!r}; "
                              f"drop the flag or use --strategy zero2, zero3 or fsdp")
        out.append({registry.flavour(flavour).table: {key: value}})
    return out


def _fail(rank: int, msg: str) -> int:
    """Report an error every rank found before MPI started; exit code 2 on every rank.

    Rank 0 prints the line. A launcher tears the job down at the first non-zero exit, so
    the other ranks wait for that before exiting; if nothing tears them down (a launcher
    that waits for every rank), they print the line themselves, so it is never lost.
    """
    if rank != 0:
        import time

        time.sleep(_FAIL_WAIT_S)
    print(f"hpctrain: error: {msg}", file=sys.stderr, flush=True)
    return 2


_FAIL_WAIT_S = 10.0


def _prepare(args, launch):
    """Config, preflight checks and the model: everything before MPI. Returns (cfg, built)
    or an exit code."""
    rank, size = launch.rank, launch.size
    try:
        cfg = load_config(args.config, _overrides(args))
        sharded = _sharded_overrides(args, cfg, size)
        if sharded:
            cfg = load_config(args.config, _overrides(args) + sharded)
        plan = cfg.check(size)  # the plan, built once
    except ConfigError as exc:
        return _fail(rank, str(exc))
    if args.print_config:
        if rank == 0:
            print(cfg.to_toml())
        return 0
    from hpctrain.train.preflight import check_dataset, preflight

    try:
        preflight(cfg, os.environ, launch)
    except (ConfigError, UsageError) as exc:
        return _fail(rank, str(exc))
    from hpctrain.train.build import build_model

    try:
        built = build_model(cfg, plan=plan)  # imports a user's factory: fail here, before MPI starts
    except ConfigError as exc:  # train.model_options
        return _fail(rank, str(exc))
    except (ValueError, TypeError, ImportError) as exc:
        return _fail(rank, f"train.model = {cfg.train.model!r}: {exc}")
    except OSError as exc:  # e.g. the data set file cannot be written
        return _fail(rank, f"train.model = {cfg.train.model!r}: cannot build its data set: "
                           f"{exc}; set HPCTRAIN_DATA_DIR to a writable directory")
    try:
        check_dataset(cfg, len(built.dataset))
    except ConfigError as exc:
        return _fail(rank, str(exc))
    from hpctrain.train.checked import check_run

    try:  # every check of the model against the plan
        checked = check_run(cfg, plan, built)
    except (UsageError, ValueError) as exc:
        return _fail(rank, str(exc))
    return cfg, built, checked


def cmd_train(args) -> int:
    """Validate everything that needs no communication, then start MPI and train."""
    from hpctrain.runtime.launcher import detect_launcher
    from hpctrain.runtime.world import check_launch_size

    try:
        launch = detect_launcher(os.environ)
        check_launch_size(launch)  # torchrun: no MPI world to join; every process says so
    except ValueError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2
    prepared = _prepare(args, launch)
    if isinstance(prepared, int):
        return prepared
    cfg, built, checked = prepared
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.runtime.abort import fail_together
    from hpctrain.runtime.world import init_world
    from hpctrain.train.nonfinite import NonFiniteError
    from hpctrain.train.preemption import PREEMPT_EXIT_CODE, Preempted
    from hpctrain.train.api import Trainer  # the CLI is a thin layer over the Python API

    try:
        world = init_world(cfg.runtime.ranks_per_node, cfg.runtime.device)
    except UsageError as exc:
        # srun without PMI: each process is alone in its MPI world, so each one says it.
        return fail_together(str(exc), code=2)
    trainer = Trainer(cfg, world=world, built=built, checked=checked,
                      force_unlock=args.force_unlock)
    try:
        trainer.setup()
    except UserInputError as exc:
        # What the plan cannot run, found building it (the model's layers, its inputs): the
        # same on every rank, so one line and exit 2, like an error found before MPI; some
        # ranks only: abort.
        return fail_together(str(exc), code=2)
    except CheckpointError as exc:  # the resume file
        return fail_together(str(exc))
    try:
        trainer.fit()
    except Preempted:
        return PREEMPT_EXIT_CODE  # checkpoint written; rerun (or the requeued job) resumes
    except NonFiniteError as exc:  # every rank at the same step; no checkpoint from it
        return fail_together(str(exc), code=NONFINITE_EXIT_CODE)
    except (CheckpointError, UsageError) as exc:
        # A sentence, not a traceback. If some rank did not raise too, the job is aborted.
        return fail_together(str(exc))
    return 0
