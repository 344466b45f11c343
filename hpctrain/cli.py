"""Command line: ``python -m hpctrain {train,doctor,ckpt,bench}`` (also the ``hpctrain`` script)."""

from __future__ import annotations

import argparse
import os
import sys

from hpctrain import __version__
from hpctrain.config import ConfigError, load_config, parse_assignment

__all__ = ["main", "build_parser"]

# flag -> (section, key); the flags override the TOML file.
TRAIN_FLAGS = {
    "strategy": ("train", "strategy", str, "parallel strategy: single, ddp, zero1, zero2, zero3, fsdp"),
    "model": ("train", "model", str, "built-in model (mlp, gpt) or package.module:factory"),
    "steps": ("train", "steps", int, "optimizer steps"),
    "global_batch_size": ("train", "global_batch_size", int, "samples per step over all ranks"),
    "lr": ("train", "lr", float, "learning rate"),
    "optimizer": ("train", "optimizer", str, "sgd or adamw"),
    "weight_decay": ("train", "weight_decay", float, "weight decay"),
    "seed": ("train", "seed", int, "seed for weights and data"),
    "precision": ("train", "precision", str, "fp32, bf16 or fp16"),
    "grad_accum": ("train", "grad_accum", int, "micro-batches per optimizer step"),
    "max_grad_norm": ("train", "max_grad_norm", float, "clip to this global gradient norm"),
    "summary": ("train", "summary", str, "write a JSON summary here (rank 0)"),
    "out_dir": ("train", "out_dir", str, "directory for metrics.csv"),
    "progress": ("train", "progress", str, "progress bar: auto, on, off"),
    "log_every": ("train", "log_every", int, "log every N steps without a progress bar"),
    "mesh": ("runtime", "mesh", str, "mesh degrees, e.g. dp=2,pp=2"),
    "ranks_per_node": ("runtime", "ranks_per_node", int, "pretend N ranks per node"),
    "device": ("runtime", "device", str, "auto, cpu or cuda"),
    "checkpoint_dir": ("checkpoint", "dir", str, "write checkpoints to this directory"),
    "checkpoint_every": ("checkpoint", "every", int, "checkpoint every N steps"),
    "keep": ("checkpoint", "keep", int, "keep the newest K checkpoints (0: all)"),
    "resume": ("checkpoint", "resume", str, "auto (newest in --checkpoint-dir) or a ckpt file"),
    "fusion_threshold_mb": ("ddp", "fusion_threshold_mb", float, "Horovod tensor fusion MB"),
    "sharding_strategy": ("fsdp", "sharding_strategy", str,
                          "fsdp: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD"),
    "auto_wrap_policy": ("fsdp", "auto_wrap_policy", str, "fsdp units: blocks, class, size, none"),
}
BOOL_FLAGS = {
    "activation_checkpointing": ("train", "activation_checkpointing", "recompute activations"),
    "fp16_compression": ("ddp", "fp16_compression", "fp16 gradient compression (ddp)"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpctrain", description="Train PyTorch models on supercomputers.")
    p.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("train", help="train a model (default: gpt, single process)")
    t.add_argument("--config", metavar="FILE.toml", help="TOML config; flags override it")
    for name, (_, _, tp, help_) in TRAIN_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=tp, help=help_)
    for name, (_, _, help_) in BOOL_FLAGS.items():
        t.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true", default=None,
                       help=help_)
    t.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set ddp.cycle_time_ms=2")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    sub.add_parser("doctor", help="check MPI, Horovod, parallel HDF5, torch and the launcher")
    c = sub.add_parser("ckpt", help="inspect or export a checkpoint")
    csub = c.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ci = csub.add_parser("inspect", help="datasets, shapes, step, strategy; verify checksums")
    ci.add_argument("path")
    ce = csub.add_parser("export", help="write the full model state (no optimizer) to OUT.h5")
    ce.add_argument("path")
    ce.add_argument("out")
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    bc = bsub.add_parser("checkpoint", help="hpctrain vs torch.distributed.checkpoint vs dd")
    bc.add_argument("--mb", type=int, default=400, help="model state size in MB")
    bc.add_argument("--dir", default="", help="directory on the disk to test (default: a temp dir)")
    bm = bsub.add_parser("memory", help="peak RSS per rank of each strategy vs the ZeRO formula "
                         "and torch FSDP2")
    bm.add_argument("--params-m", type=float, default=20.0, help="model size, millions of params")
    bm.add_argument("--steps", type=int, default=3, help="AdamW steps before reading the peak")
    bm.add_argument("--strategies", type=_strategy_list,
                    default="single,ddp,zero1,zero2,zero3,fsdp,fsdp2",
                    help="comma-separated (single runs only on 1 rank)")
    bm.add_argument("--mmap-threshold-kb", type=int, default=256,
                    help="fix glibc's mmap threshold in the measured ranks (0: glibc's dynamic "
                         "default, which keeps freed multi-MB tensors resident; runtime/malloc.py"
                         " explains the step-time cost)")
    bs = bsub.add_parser("step", help="step time of zero3 and fsdp vs torch FSDP2, ddp for "
                         "reference")
    bs.add_argument("--params-m", type=float, default=20.0, help="model size, millions of params")
    bs.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    bs.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    bs.add_argument("--batch", type=int, default=32, help="samples per rank")
    bs.add_argument("--strategies", type=_strategy_list, default="zero3,fsdp,fsdp2,ddp",
                    help="comma-separated")
    return p


def _strategy_list(text: str) -> tuple:
    from hpctrain.bench.workload import STRATEGIES

    names = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected names from {', '.join(STRATEGIES)}")
    return names


def _overrides(args) -> list[dict]:
    out = [parse_assignment(a) for a in args.assignments]
    for name, (section, key, *_rest) in {**TRAIN_FLAGS, **BOOL_FLAGS}.items():
        value = getattr(args, name)
        if value is not None:
            out.append({section: {key: value}})
    return out


def _launch_rank_size() -> tuple[int, int]:
    from hpctrain.runtime.launcher import detect_launcher

    info = detect_launcher(os.environ)
    return info.rank, info.size


def _fail(rank: int, msg: str) -> int:
    # Every rank fails identically; one copy of the message is enough.
    if rank == 0:
        print(f"hpctrain: error: {msg}", file=sys.stderr, flush=True)
    return 2


def cmd_train(args) -> int:
    """Validate everything that needs no communication, then start MPI and train."""
    try:
        rank, size = _launch_rank_size()
    except ValueError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, _overrides(args)).validate(size)
    except ConfigError as exc:
        return _fail(rank, str(exc))
    if args.print_config:
        if rank == 0:
            print(cfg.to_toml())
        return 0
    from hpctrain.train.trainer import Trainer, build_model

    try:
        built = build_model(cfg)  # imports a user's factory: fail here, before MPI starts
    except (ValueError, TypeError, ImportError) as exc:
        return _fail(rank, f"train.model = {cfg.train.model!r}: {exc}")
    from hpctrain.checkpoint import CheckpointError

    try:
        Trainer(cfg, built=built).fit()
    except (CheckpointError, FileNotFoundError) as exc:
        # Every rank agreed on the error before raising; each says so (no hang, no traceback).
        print(f"hpctrain: error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_ckpt(args) -> int:
    from hpctrain.checkpoint.tools import export, inspect

    if args.ckpt_command == "inspect":
        return inspect(args.path)
    return export(args.path, args.out)


def cmd_bench(args) -> int:
    if args.bench_command == "memory":
        from hpctrain.bench.memory import run as run_memory

        return run_memory(args.params_m, args.steps, args.strategies,
                          mmap_threshold_kb=args.mmap_threshold_kb)
    if args.bench_command == "step":
        from hpctrain.bench.step import run as run_step

        return run_step(args.params_m, args.steps, args.warmup, args.batch, args.strategies)
    from hpctrain.bench.checkpoint import run

    return run(args.mb, args.dir)


def cmd_doctor(args) -> int:
    from hpctrain.doctor import run_doctor

    return run_doctor()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 0
    if args.command == "train":
        return cmd_train(args)
    if args.command == "doctor":
        return cmd_doctor(args)
    if args.command == "ckpt":
        return cmd_ckpt(args)
    if args.command == "bench":
        return cmd_bench(args)
    raise RuntimeError(f"unhandled command {args.command}")  # argparse rejects unknown ones
