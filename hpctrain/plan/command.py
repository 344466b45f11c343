"""``python -m hpctrain plan``: which parallel plans fit N ranks with M GB each.

Everything here runs in one process with no MPI: the model is read on the meta device,
every plan is checked by hpctrain's own config validation and priced by estimate.py.
"""

from __future__ import annotations

import sys

__all__ = ["add_parser", "run", "PlanInputError"]

GPT_FLAGS = ("layers", "hidden", "heads", "vocab", "seq")


class PlanInputError(ValueError):
    """The request cannot be planned; exit code 2 with this one line."""


def add_parser(sub) -> None:
    """The ``plan`` subcommand's flags (no heavy imports: every command builds the parser)."""
    p = sub.add_parser(
        "plan", help="which strategies (ddp, zero1-3, fsdp, pipeline, tensor, composed) fit "
        "N ranks with M GB each: per-rank memory, communication, the command to run",
        description="Price every plan hpctrain can run for a model at a world size: "
        "per-rank params, grads, optimizer state (ZeRO paper), activations (Megatron's "
        "formula), communication per step; recommend one with its command and TOML.")
    p.add_argument("--model", default="gpt", help="built-in model (gpt, mlp) or "
                   "package.module:factory (default gpt)")
    g = p.add_argument_group("a GPT-style decoder by size (the built-in gpt; a flag not "
                             "given keeps the gpt's default)")
    g.add_argument("--layers", type=int, help="transformer blocks")
    g.add_argument("--hidden", type=int, help="hidden size (d_model)")
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--vocab", type=int, help="vocabulary size")
    g.add_argument("--seq", type=int, help="sequence length")
    p.add_argument("--ranks", type=int, help="ranks in all (default nodes x ranks-per-node)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="ranks (GPUs) per node (default: --ranks on one node)")
    p.add_argument("--memory-gb", type=float, required=True,
                   help="memory per rank in GB (1e9 bytes), e.g. 80 for an 80 GB GPU")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="fp32, or bf16/fp16 mixed precision (ZeRO's 2+2+12 bytes/param)")
    p.add_argument("--states", choices=("zero-paper", "autocast"), default="zero-paper",
                   help="bytes per parameter under bf16/fp16: zero-paper (2+2+12, fp32 "
                   "master copy in the optimizer: DeepSpeed/Megatron style) or autocast "
                   "(hpctrain's own mixed precision: fp32 params, grads and state, 4+4+8)")
    p.add_argument("--optimizer", default="adamw",
                   help="any torch.optim optimizer by name (adamw, sgd, adagrad, ...); its "
                   "state per parameter is measured on a probe")
    p.add_argument("--momentum", type=float, default=0.0,
                   help="momentum, for optimizers that take one (SGD, RMSprop; 0: none)")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="pipeline micro-batches per (grad-accumulation) batch")
    p.add_argument("--reduce-bucket-size", type=int, default=1 << 24, metavar="BYTES",
                   help="zero2/zero3/fsdp gradient-reduction buffers alive at once (default "
                        "16777216; priced with what the MPI backend stages to receive)")
    p.add_argument("--allgather-bucket-size", type=int, default=1 << 30, metavar="BYTES",
                   help="fsdp prefetches the next unit only when it fits in this (default "
                        "1073741824)")
    p.add_argument("--fitting", action="store_true",
                   help="list only the plans that fit (with or without checkpointing)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--chart", metavar="PATH", default="",
                   help="also draw per-rank memory per plan as a bar chart (PNG)")


def _shape(args):
    from hpctrain.plan.model_shape import ShapeError, gpt_shape, shape_of

    given = {k: getattr(args, k) for k in GPT_FLAGS if getattr(args, k) is not None}
    try:
        if given:
            if args.model != "gpt":
                raise PlanInputError(f"--{', --'.join(given)} describe the built-in gpt; "
                                     f"drop them or use --model gpt (not {args.model!r})")
            from hpctrain.models.gpt import DEFAULTS

            dims = {"layers": DEFAULTS["layers"], "hidden": DEFAULTS["d_model"],
                    "heads": DEFAULTS["heads"], "vocab": DEFAULTS["vocab"],
                    "seq": DEFAULTS["seq_len"], **given}
            return gpt_shape(**dims)
        return shape_of(args.model)
    except ShapeError as exc:
        raise PlanInputError(f"cannot build the model: {exc}") from None


def _request(args):
    from hpctrain.plan.candidates import Request

    from hpctrain.plan.estimate import optimizer_state_bytes

    if args.nodes < 1:
        raise PlanInputError(f"--nodes {args.nodes}: expected at least 1")
    try:
        optimizer_state_bytes(args.optimizer, args.momentum)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    rpn = args.ranks_per_node
    ranks = args.ranks if args.ranks is not None else args.nodes * rpn
    if ranks is None or ranks < 1:
        raise PlanInputError("give the ranks: --ranks N, or --nodes N --ranks-per-node R "
                             f"(got {ranks} ranks)")
    if args.ranks is not None and rpn and args.ranks != args.nodes * rpn:
        raise PlanInputError(f"--ranks {args.ranks} is not --nodes {args.nodes} x "
                             f"--ranks-per-node {rpn} = {args.nodes * rpn}")
    if rpn and ranks % rpn:
        raise PlanInputError(f"{ranks} ranks do not fill nodes of {rpn}")
    for name in ("memory_gb", "global_batch", "grad_accum", "micro_batches",
                 "reduce_bucket_size", "allgather_bucket_size"):
        if getattr(args, name) <= 0:
            raise PlanInputError(f"--{name.replace('_', '-')} {getattr(args, name)}: "
                                 f"expected a positive number")
    return Request(ranks=ranks, ranks_per_node=rpn or ranks // args.nodes,
                   memory_gb=args.memory_gb, precision=args.precision,
                   optimizer=args.optimizer, momentum=args.momentum,
                   global_batch=args.global_batch, grad_accum=args.grad_accum,
                   microbatches=args.micro_batches, autocast=args.states == "autocast",
                   reduce_bucket_size=args.reduce_bucket_size,
                   allgather_bucket_size=args.allgather_bucket_size)


def _no_plan(req, refused: list) -> str:
    """Why no plan runs at these ranks: the distinct reasons hpctrain gave."""
    reasons = list(dict.fromkeys(why for _, why in refused))
    shown = "; ".join(reasons[:2]) + (f" (and {len(reasons) - 2} more)"
                                       if len(reasons) > 2 else "")
    return f"no plan runs on {req.ranks} ranks: {shown or 'the model cannot be split'}"


def plan(args):
    """(estimates, request, shape, best) for the parsed arguments (PlanInputError)."""
    from hpctrain.plan.candidates import candidates
    from hpctrain.plan.estimate import estimate
    from hpctrain.plan.render import recommend

    shape = _shape(args)
    req = _request(args)
    ok, refused = candidates(shape, req)
    if not ok:
        raise PlanInputError(_no_plan(req, refused))
    estimates = [estimate(shape, c, req) for c in ok]
    return estimates, req, shape, recommend(estimates)


def run(args) -> int:
    """Exit 0 with a recommendation, 1 when no plan fits the memory, 2 on bad input."""
    from hpctrain.plan import render

    try:
        estimates, req, shape, best = plan(args)
    except PlanInputError as exc:
        print(f"hpctrain plan: error: {exc}", file=sys.stderr)
        return 2
    shown = [e for e in estimates if e.fits or e.fits_with_ac or not args.fitting]
    if args.chart:
        render.chart(shown or estimates, req, args.chart)
    if args.json:
        print(render.to_json(shown, req, shape, best))
    else:
        print(render.table(shown) if shown else "(no plan fits)")
        print()
        print(render.legend(shape, req))
        if best is not None:
            print(f"\nrecommended: {render.describe(best, not best.fits)}: "
                  f"{render.human(best.needed)} of {req.memory_gb:g} GB per rank")
            print(f"  {render.command(best, req, shape)}")
            print("\nor as --config FILE.toml:")
            print(render.toml(best, req, shape), end="")
        if args.chart:
            print(f"\nchart: {args.chart}")
    if best is None:
        smallest = min(estimates, key=lambda e: e.needed)
        print(f"hpctrain plan: no plan fits: the smallest plan, "
              f"{render.describe(smallest, smallest.total_ac < smallest.total)}, "
              f"needs {smallest.needed / 1e9:.1f} GB per rank; you gave "
              f"{req.memory_gb:g} GB", file=sys.stderr)
        return 1
    return 0

