"""Command line: ``python -m hpctrain {train,doctor,ckpt,trace,bench,jobgen,report,plan}``
(also the ``hpctrain`` script); ``build_parser`` declares each command."""

from __future__ import annotations

import argparse
import os
import sys

from hpctrain.version import __version__
from hpctrain.bench.gpu.common import PARTS as GPU_PARTS
from hpctrain.cli_train import _overrides, add_train_parser, cmd_train, positive_int

__all__ = ["main", "build_parser", "cmd_train", "_overrides"]


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line, as every other input error (not the whole usage)."""

    def error(self, message):
        self.exit(2, f"hpctrain: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hpctrain", description="Train PyTorch models on supercomputers.")
    p.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    add_train_parser(sub)
    sub.add_parser("doctor", help="check MPI, Horovod, parallel HDF5, torch and the launcher")
    c = sub.add_parser("ckpt", help="inspect or export a checkpoint")
    csub = c.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    ci = csub.add_parser("inspect", help="datasets, shapes, step, strategy; verify checksums")
    ci.add_argument("path")
    ce = csub.add_parser("export", help="write the full model state (no optimizer) to OUT.h5")
    ce.add_argument("path")
    ce.add_argument("out")
    tr = sub.add_parser("trace", help="read records a run left behind")
    trsub = tr.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    tf = trsub.add_parser("flight", help="where the ranks' flight records (flight-rank-R.json, "
                          "written on a stall) diverge")
    tf.add_argument("out_dir")
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    bc = bsub.add_parser("checkpoint", help="hpctrain vs torch.distributed.checkpoint vs dd")
    bc.add_argument("--mb", type=positive_int, default=400, help="model state size in MB")
    bc.add_argument("--dir", default="", help="directory on the disk to test (default: a temp dir)")
    bf = bsub.add_parser("flight", help="the flight recorder's share of a training step "
                         "(budget <= 1%% of a >= 50 ms step); run under the launcher")
    bf.add_argument("--strategy", default="zero3", help="strategy to time")
    bf.add_argument("--model", default="gpt", help="built-in model")
    bf.add_argument("--steps", type=int, default=2, help="steps per block")
    bf.add_argument("--blocks", type=int, default=64, help="on/off blocks, ABBA order (a multiple of 4)")
    bf.add_argument("--batch", type=int, default=16, help="global batch size")
    bf.add_argument("--sizes", default="",
                    help="gpt sizes to time (tiny: the defaults; medium: d_model 192, 4 layers, "
                    "the CPU budget step; gpu: d_model 1024, 8 layers, the GPU budget step); "
                    "default: tiny,medium on CPU, gpu on a GPU")
    bf.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the ranks train (auto: a GPU when one is visible)")
    bf.add_argument("--control", action="store_true",
                    help="A/A run: the recorder on in both modes (the ratio shows the noise)")
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
    bm.add_argument("--reduce-bucket-size", type=positive_int, default=None, metavar="BYTES",
                    help="zero2/zero3/fsdp reduce_bucket_size (default the options')")
    bm.add_argument("--allgather-bucket-size", type=positive_int, default=None,
                    metavar="BYTES", help="fsdp allgather_bucket_size (default the options')")
    bs = bsub.add_parser("step", help="step time of ddp, zero1-3 and fsdp vs torch DDP, torch "
                         "FSDP2 and the no-communication floor, with targets")
    bs.add_argument("--params-m", type=float, default=20.0, help="model size, millions of params")
    bs.add_argument("--width", type=positive_int, default=1024, help="layer width")
    bs.add_argument("--steps", type=positive_int, default=10, help="timed steps (median)")
    bs.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    bs.add_argument("--batch", type=positive_int, default=32, help="samples per rank")
    bs.add_argument("--strategies", type=_strategy_list,
                    default="nocomm,torchddp,ddp,zero1,zero2,zero3,fsdp,fsdp:NO_SHARD,"
                            "pp2:ddp,pp2:zero3",
                    help="comma-separated from ddp, zero1, zero2, zero3, fsdp (FULL_SHARD), "
                         "fsdp:SHARD_GRAD_OP, fsdp:NO_SHARD, pp2:ddp, pp2:zero2, pp2:zero3 "
                         "(two pipeline stages, the flavour over their replicas), fsdp2 "
                         "(torch FSDP2), torchddp (torch DDP), nocomm (no communication: the "
                         "compute floor)")
    bs.add_argument("--json", dest="json_path", default="", metavar="PATH",
                    help="also write the medians and ratios as JSON to PATH")
    bp = bsub.add_parser("pipeline", help="pipeline bubble per stage vs (p-1)/(m+p-1), "
                         "throughput vs torch.distributed.pipelining (gloo)")
    bp.add_argument("--pp", type=_int_list, default=(2, 4), help="pipeline depths, e.g. 2,4")
    bp.add_argument("--microbatches", type=_int_list, default=(4, 8, 16), help="values of m")
    bp.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b", help="comma-separated")
    bp.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (interleaved)")
    bp.add_argument("--layers", type=int, default=16, help="identical layers")
    bp.add_argument("--width", type=int, default=512, help="layer width")
    bp.add_argument("--model", default="linear", help="linear: Linear+GELU layers; timed: "
                    "layers that busy-wait --layer-ms (equal stages whatever each core's speed)")
    bp.add_argument("--layer-ms", type=float, default=0.5, help="timed model: forward ms per "
                    "layer (backward: twice that)")
    bp.add_argument("--layer-sleep", action="store_true", help="timed model: layers sleep "
                    "instead of spinning, as a stage computing on a GPU leaves its host core "
                    "idle (more stages than cores can then run side by side)")
    bp.add_argument("--p2p", default="eager", help="eager (non-blocking sends, the CPU default) "
                    "or ordered (NCCL's grouped order, with synchronous MPI sends)")
    bp.add_argument("--micro-batch", type=int, default=128, help="samples per micro-batch")
    bp.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    bp.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    bp.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    bp.add_argument("--wait", default="sleep", help="how blocked receives wait, comma-separated "
                    "to compare: spin (MPI busy-poll), yield, sleep")
    bt = bsub.add_parser("tp", help="tensor-parallel step time (tp = the ranks launched) vs "
                         "torch's parallelize_module (gloo) and one rank; bytes per step vs "
                         "Megatron's formula")
    bt.add_argument("--layers", type=positive_int, default=4, help="GPT blocks in the stack")
    bt.add_argument("--d-model", type=positive_int, default=512, help="hidden size")
    bt.add_argument("--heads", type=positive_int, default=8, help="attention heads (divisible "
                    "by tp)")
    bt.add_argument("--seq-len", type=positive_int, default=256, help="sequence length "
                    "(divisible by tp)")
    bt.add_argument("--batch", type=positive_int, default=4, help="sequences per step (every "
                    "tp rank reads the same batch)")
    bt.add_argument("--steps", type=positive_int, default=5, help="timed steps (median)")
    bt.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    bt.add_argument("--sequence-parallel", choices=("off", "on", "both"), default="both",
                    help="configurations to run")
    bt.add_argument("--no-torch", action="store_true", help="skip torch's tensor parallel")
    bt.add_argument("--json", dest="json_path", default="", metavar="PATH",
                    help="also write the table as JSON to PATH")
    bpl = bsub.add_parser("plan", help="every plan `hpctrain plan` prices for a tiny gpt "
                          "and a Linear stack, run one step: estimated vs measured bytes per "
                          "rank (targets: states 10%%, activations 20%%); run under the "
                          "launcher")
    bpl.add_argument("--models", default="gpt,stack",
                     help="which models: gpt, stack, hf-gpt2 (a tiny Hugging Face GPT-2, "
                     "split as the pipeline splits it; needs transformers)")
    bg = bsub.add_parser("gpu", help="the prepared GPU check: speed vs plain torch, every plan "
                         "on the device vs single, memory, watchdog, overlap; writes "
                         "DIR/report.json and DIR/report.md (exit 0: every part ran clean)")
    bg.add_argument("--out", default="hpctrain-gpu-check", metavar="DIR", help="report directory")
    bg.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu with --tiny: the same check in seconds (the suite runs it)")
    bg.add_argument("--tiny", action="store_true", help="tiny sizes (CPU test)")
    bg.add_argument("--parts", default=",".join(GPU_PARTS),
                    help=f"comma-separated parts to run, in this order: {','.join(GPU_PARTS)}")
    bg.add_argument("--scale", type=float, default=1.0,
                    help="multiply every part's time box (e.g. 0.5 for a short rerun)")
    bh = bsub.add_parser("halo", help="halo exchange vs raw MPI Sendrecv; U-Net step time at "
                         "N ranks vs 1 on the same grid, with and without overlap")
    bh.add_argument("--size", type=int, default=512, help="exchange bench: global grid side")
    bh.add_argument("--channels", type=int, default=32, help="exchange bench: channels")
    bh.add_argument("--batch", type=int, default=2, help="samples")
    bh.add_argument("--reps", type=int, default=50, help="exchange repetitions (median)")
    bh.add_argument("--wide", type=int, default=4096, help="second exchange: a 1x64 field this "
                    "wide, 8 rows per rank (2 MiB halos at 4096); 0 skips it")
    bh.add_argument("--model-size", type=int, default=256, help="U-Net grid side (multiple of 4)")
    bh.add_argument("--base", type=int, default=16, help="U-Net base channels")
    bh.add_argument("--steps", type=int, default=5, help="timed U-Net steps (median)")
    bh.add_argument("--warmup", type=int, default=2, help="untimed U-Net steps first")
    _add_jobgen_parser(sub)
    _add_report_parser(sub)
    from hpctrain.plan.command import add_parser as add_plan_parser

    add_plan_parser(sub)
    return p


def _int_list(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


# ---- report: redraw a run's report.png, or overlay several runs ----------------------------

def _add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="draw a run's report.png again, or overlay several runs "
                       "(loss and validation, |loss - first run's|, lr, gradient norm, "
                       "throughput, peak memory per rank); prints each setting the runs differ in")
    r.add_argument("out_dirs", nargs="+", metavar="OUT_DIR",
                   help="a run's --out-dir (metrics.csv, summary.json)")
    r.add_argument("-o", "--output", metavar="PATH", help="the PNG to write (default: "
                   "OUT_DIR/report.png for one run, report-overlay.png here for several)")
    r.add_argument("--labels", metavar="A,B,...", help="legend names, one per run (default: "
                   "each run's strategy from its summary.json)")


def cmd_report(args) -> int:
    """Draw the runs' picture; a bad directory or a missing matplotlib is one line, exit 2."""
    from hpctrain.train.report import REPORT_NAME, draw_report
    from hpctrain.train.report_runs import ReportError, differences, load_runs

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    default = (os.path.join(args.out_dirs[0], REPORT_NAME) if len(args.out_dirs) == 1
               else "report-overlay.png")
    try:
        runs = load_runs(args.out_dirs, labels)
        path = draw_report(runs, args.output or default)
    except ReportError as exc:
        print(f"hpctrain report: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"hpctrain report: error: {exc}; pip install matplotlib", file=sys.stderr)
        return 2
    for line in differences(runs):  # why the overlaid curves may differ (also in the title)
        print(f"hpctrain report: {line}")
    print(f"hpctrain: report {path}")
    return 0


def _add_jobgen_parser(sub) -> None:
    from hpctrain.jobgen import JobSpec

    d = JobSpec()
    j = sub.add_parser("jobgen", help="write a SLURM or PBS job script (the templates of jobs/)")
    j.add_argument("--scheduler", choices=("slurm", "pbs"), default=d.scheduler)
    j.add_argument("--nodes", type=int, default=d.nodes)
    j.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node,
                   help="GPUs per node, one rank each (0: a CPU job)")
    j.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node, help="CPU jobs")
    j.add_argument("--cpus-per-task", type=int, default=d.cpus_per_task,
                   help="cores per rank (default 1 on CPU, 8 per GPU rank)")
    j.add_argument("--time", default=d.time, help="HH:MM:SS or D-HH:MM:SS")
    j.add_argument("--partition", "--queue", dest="partition", default=d.partition,
                   help="SLURM partition / PBS queue (default: a commented SITE line)")
    j.add_argument("--account", default=d.account, help="allocation to charge")
    j.add_argument("--preemptible", action="store_true",
                   help="requeue on a signal: --requeue --signal=USR1@90 / -r y, checkpoints")
    j.add_argument("--job-name", default=d.job_name)
    j.add_argument("--strategy", default=d.strategy)
    j.add_argument("--model", default=d.model)
    j.add_argument("--steps", type=int, default=d.steps)
    j.add_argument("--checkpoint-dir", default=d.checkpoint_dir)
    j.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    j.add_argument("-o", "--output", default="", help="write here (default: stdout)")
    j.add_argument("--presets", metavar="DIR", default="",
                   help="write every script of the repository's jobs/ into DIR and exit")


def _strategy_list(text: str) -> tuple:
    from hpctrain.bench.workload import STRATEGIES, resolve

    names = []
    for s in (s.strip() for s in text.split(",")):
        try:
            names += [resolve(s)] if s else []
        except ValueError:
            names = []
            break
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected names from {', '.join(STRATEGIES)}")
    return tuple(dict.fromkeys(names))


def cmd_ckpt(args) -> int:
    """inspect or export; a bad file or output path is one ``hpctrain: error`` line."""
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.checkpoint.tools import export, inspect

    try:
        code = inspect(args.path) if args.ckpt_command == "inspect" else export(args.path, args.out)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, where it is handled
        return code
    except CheckpointError as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # As any Unix tool: stop quietly; point stdout at /dev/null so the exit flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe closed on


def cmd_bench(args) -> int:
    if args.bench_command == "flight":
        from hpctrain.bench.flight import run as run_flight

        return run_flight(args.strategy, args.model, args.steps, args.blocks, args.batch,
                          args.sizes, args.control, args.device)
    if args.bench_command == "memory":
        from hpctrain.bench.memory import run as run_memory

        buckets = {k: getattr(args, k) for k in ("reduce_bucket_size", "allgather_bucket_size")
                   if getattr(args, k) is not None}
        return run_memory(args.params_m, args.steps, args.strategies,
                          mmap_threshold_kb=args.mmap_threshold_kb, buckets=buckets)
    if args.bench_command == "halo":
        from hpctrain.bench.halo import run as run_halo

        return run_halo(args.size, args.channels, args.batch, args.reps, args.model_size,
                        args.base, args.steps, args.warmup, args.wide)
    if args.bench_command == "step":
        from hpctrain.bench.step import run as run_step

        return run_step(args.params_m, args.steps, args.warmup, args.batch, args.strategies,
                        width=args.width, json_path=args.json_path)
    if args.bench_command == "pipeline":
        from hpctrain.bench.pipeline import run as run_pipeline

        return run_pipeline(args.pp, args.microbatches, tuple(args.schedules.split(",")),
                            args.virtual_stages, args.layers, args.width, args.micro_batch,
                            args.steps, args.warmup, not args.no_torch,
                            tuple(args.wait.split(",")), args.model, args.layer_ms, args.p2p,
                            args.layer_sleep)
    if args.bench_command == "plan":
        from hpctrain.bench.plan import run as run_plan_bench

        return run_plan_bench(models=tuple(m for m in args.models.split(",") if m))
    if args.bench_command == "gpu":
        from hpctrain.bench.gpu.check import run as run_gpu_check

        return run_gpu_check(args.out, args.device, args.tiny,
                             tuple(p for p in args.parts.split(",") if p), args.scale)
    if args.bench_command == "tp":
        from hpctrain.bench.tensor import run as run_tp

        return run_tp(args.layers, args.d_model, args.heads, args.seq_len, args.batch,
                      args.steps, args.warmup, args.sequence_parallel, not args.no_torch,
                      json_path=args.json_path)
    from hpctrain.bench.checkpoint import run

    return run(args.mb, args.dir)


def cmd_jobgen(args) -> int:
    import dataclasses

    from hpctrain.jobgen import JobSpec, render, write_presets

    if args.presets:
        for path in write_presets(args.presets):
            print(path)
        return 0
    spec = JobSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(JobSpec)})
    try:
        text = render(spec, args.output)
    except ValueError as exc:
        print(f"hpctrain jobgen: error: {exc}", file=sys.stderr)
        return 2
    if not args.output:
        sys.stdout.write(text)
        return 0
    with open(args.output, "w") as fh:
        fh.write(text)
    os.chmod(args.output, 0o755)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    from hpctrain.plan.command import run as run_plan

    return run_plan(args)


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
    if args.command == "trace":
        from hpctrain.runtime.flight_trace import format_divergences

        text, code = format_divergences(args.out_dir)
        print(text)
        return code
    if args.command == "jobgen":
        return cmd_jobgen(args)
    if args.command == "report":
        return cmd_report(args)
    if args.command == "plan":
        return cmd_plan(args)
    raise RuntimeError(f"unhandled command {args.command}")  # argparse rejects unknown ones
