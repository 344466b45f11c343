"""The pipeline transform (``prepare``): the model as a chain of layers, split into balanced
stages (by parameter count or measured time), this rank's stage(s) built, tied parameters
joined across stages, and its PipelineExecutor."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.errors import UsageError
from hpctrain.models.chain import split_model
from hpctrain.models.layers import LayerStack, check_input, run_layer, split_input
from hpctrain.parallel.pipeline import plan, schedule as sched
from hpctrain.parallel.pipeline import p2p_plan
from hpctrain.parallel.pipeline.engine import Engine
from hpctrain.parallel.pipeline.executor import PipelineExecutor, allgather_json, layer_paths
from hpctrain.parallel.pipeline.options import PipelineOptions
from hpctrain.parallel.pipeline.p2p import P2P_MODES, StageLinks, ordered_mode
from hpctrain.parallel.placement import Copies, place, placement_of
from hpctrain.parallel.sharding.engine import broadcast_state

__all__ = ["Probe", "prepare", "resolve_layout"]


@dataclass(frozen=True)
class Probe:
    """What the run hands the pipeline beside its options (the orchestrator builds it from
    the data set): ``sample``, one micro-batch input to time the layers on (balance =
    "measured") or to check a user module's split on; its ``target`` and the ``loss_fn``
    ("measured" times the last layer with the loss, as the last stage runs it); and
    ``unit_count``, target -> the units its loss is a mean over (train.loss_weight): a piece
    of a micro-batch counts by its share of them (None: by its rows)."""

    sample: object = None
    target: object = None
    loss_fn: object = None
    unit_count: object = None


def resolve_layout(mesh, world_size: int):
    """The mesh layout of a pipeline run: a MeshLayout (the orchestrator passes the plan's),
    or for the Python API a string; '' means every rank is a stage (pp = world size)."""
    from hpctrain.runtime.mesh import MeshLayout

    if not isinstance(mesh, MeshLayout):
        mesh = MeshLayout.parse(mesh or f"pp={world_size},dp=1")
    layout = mesh.resolve(world_size)
    if layout.dom_size != 1:
        raise ValueError(f"mesh {layout.describe()}: the pipeline strategy uses pp, dp and tp "
                         "(each stage tensor-parallel); set dom=1")
    return layout


def _module_layers(stack) -> dict:
    """{module path: index of the layer that holds it}: split points may name modules."""
    return {path: i for i, layer in enumerate(stack.layers) for path in layer_paths(layer)}


def _layer_costs(stack, balance: str, probe: Probe, pp, dp):
    """Per-layer cost: parameter count, or forward+backward seconds measured on each pipeline
    rank (one list per rank: the split gives a slower rank fewer layers). All ranks measure
    at once, as they compute in the steady state (one rank timing while the others wait in a
    collective would time it under their polling); replicas over dp keep their slowest time,
    so every rank computes the same split. Given a sample target and the loss, the last layer
    is timed with the loss on its output, since the last stage computes it: a costly loss
    (a large vocabulary's cross-entropy) then leaves that stage fewer layers."""
    if balance == "param-count":
        return [float(c) for c in stack.param_counts()]
    if probe.sample is None:
        raise ValueError("pipeline.balance = 'measured' needs a sample micro-batch")
    costs = torch.zeros(1, len(stack), dtype=torch.float64, device=pp.device)
    x, target, loss_fn = probe.sample, probe.target, probe.loss_fn
    x, side = split_input(stack.inputs, x)
    with_loss = loss_fn is not None and target is not None
    for i, layer in enumerate(stack.layers):
        root = stack.build([i]).to(x.device)
        # A Sequential's layers are the model's own modules: time them without training them.
        before = {k: v.detach().clone() for k, v in root.state_dict().items()}
        times = []
        for _ in range(3):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            out = run_layer(layer, root, inp, side)
            if with_loss and i == len(stack) - 1:
                loss_fn(out, target).backward()
            else:
                _first_tensor(out).float().sum().backward()
            times.append(time.perf_counter() - t0)
        costs[0, i] = sorted(times)[1]
        x = out.detach()
        with torch.no_grad():
            for k, v in root.state_dict().items():
                v.copy_(before[k])
        root.zero_grad(set_to_none=True)
        del root
    if dp.size > 1:
        dp.allreduce(costs, op="max")
    if pp.size > 1:
        costs = pp.allgather(costs)
    return costs.tolist()


def _first_tensor(out):
    """The tensor of a layer's output (a dict of one tensor: the last layer's, kept)."""
    return out if isinstance(out, torch.Tensor) else next(iter(out.values()))


def _as_stack(model, sample=None) -> LayerStack:
    """A LayerStack as given; a module split into its chain of layers (ties declared),
    checked against its forward on ``sample`` when given. TypeError for a sample input the
    layers do not take (a dict with keys they do not know)."""
    if isinstance(model, LayerStack):
        if sample is not None:
            check_input(model, sample)
        return model
    if isinstance(model, nn.Module):
        stack = split_model(model, sample)  # TypeError naming what is expected otherwise
        if sample is not None:
            check_input(stack, sample)  # an nn.Sequential's: one tensor
        return stack
    raise TypeError(f"the pipeline strategy takes an nn.Module whose forward is a chain of "
                    f"layers or a models.layers.LayerStack, got {type(model).__name__}")


def _tied_copies(stack: LayerStack, root: nn.Module) -> dict:
    """{owner's name: this rank's copy} of the trainable parameters tied across stages."""
    local = dict(root.named_parameters(remove_duplicate=False))
    out = {}
    for alias, owner in stack.tied.items():
        has_alias, has_owner = alias in local, owner in local
        shared = has_alias and has_owner and local[alias] is local[owner]
        p = local[alias if has_alias else owner] if has_alias or has_owner else None
        if p is not None and not shared and p.requires_grad:
            out.setdefault(owner, p)
    return out


def _check_tied_groups(pp, copies: dict) -> None:
    """Every stage holding a tied copy must hold the same ones: their gradients are summed
    in one group, tensor by tensor (collective over pp; all ranks raise alike)."""
    held = [names for names in allgather_json(pp, sorted(copies)) if names]
    if any(names != held[0] for names in held):
        raise UsageError(f"parameters tied across pipeline stages form different groups "
                         f"({held}); the pipeline sums tied gradients over one group of stages "
                         f"only. Fix: tie one set of parameters (e.g. embedding and head), or "
                         f"set pipeline.split_points so tied layers share a stage")


def _tie_stages(stack: LayerStack, root: nn.Module, pp):
    """(communicator over the stages holding tied copies or None, this rank's copies): the
    copies start from the first holder's values, and the step sums their gradients over
    that communicator (collective over pp)."""
    copies = _tied_copies(stack, root)
    _check_tied_groups(pp, copies)
    tied_local = [copies[name] for name in sorted(copies)]  # one order on every holder
    flags = torch.tensor([1 if tied_local else 0], dtype=torch.int64, device=pp.device)
    holders = pp.allgather(flags).tolist() if pp.size > 1 else flags.tolist()
    if not any(holders):
        return None, tied_local
    sub = pp.split(0 if tied_local else None, key=pp.rank, name="pp.tied")
    if not tied_local:
        return None, tied_local
    with torch.no_grad():
        for t in tied_local:
            sub.broadcast(t.detach(), root=0)
            # Each stage's copy gets the gradient of its own uses: summed over the holders
            # at the step, when every stage's schedule is over.
            place(t, placement_of(t).with_copies(Copies("tied", sub, partial=True,
                                                        at_step=True)))
    return sub, tied_local


def prepare(stack, world, options: PipelineOptions | None = None, flavour: str = "ddp",
            probe: Probe | None = None):
    """Build this rank's stage(s) of ``stack`` (a LayerStack, or an nn.Sequential split one
    layer per child) and the schedule; return (stage root module, executor). Collective.
    ``flavour`` is the dp flavour the orchestrator applies next (for the log line);
    ``probe`` what the run's data gives (Probe)."""
    opts = options or PipelineOptions()
    probe = probe or Probe()
    if opts.p2p not in P2P_MODES:  # pure: before any collective
        raise ValueError(f"pipeline.p2p = {opts.p2p!r}: expected one of {', '.join(P2P_MODES)}")
    stack = _as_stack(stack, probe.sample)
    layout = resolve_layout(opts.mesh, world.size)
    p, v = layout.pp, opts.chunks
    plan.check_fits(len(stack), p, v, opts.schedule)       # pure: before any collective
    actions_all = sched.build(opts.schedule, p, opts.microbatches, v)
    ordered = ordered_mode(opts.p2p, world.device, p)
    if ordered:  # NCCL matches by order and blocks sends: prove the order safe first
        p2p_plan.check_ordered(actions_all, v)
    names = [layer.name for layer in stack.layers]
    if opts.split_points:
        starts = plan.split_at(opts.split_points, names, p * v, _module_layers(stack))
    else:
        starts = None
    mesh = world.mesh(layout)
    pp, dp = mesh.comm("pp"), mesh.comm("dp")
    if starts is None:
        starts = plan.balanced_split(_layer_costs(stack, opts.balance, probe, pp, dp), p * v)
    groups = plan.stage_layers(starts, len(stack))
    my_stages = [sched.stage_of(pp.rank, c, p) for c in range(v)]
    owned = [i for g in my_stages for i in groups[g]]
    root = stack.build(owned).to(world.device)
    chunks = [[stack.layers[i] for i in groups[g]] for g in my_stages]
    # One start everywhere, whatever the user's init did (a Sequential built on every rank).
    broadcast_state(root, dp)
    tied_comm, tied_local = _tie_stages(stack, root, pp)
    links = StageLinks(pp, p * v, world.device, ordered)
    engine = Engine(root, chunks, links, pp.rank, p, opts.activation_checkpointing,
                    stack.inputs)
    executor = PipelineExecutor(stack, root, owned, engine, actions_all[pp.rank], pp, dp,
                                tied_comm, tied_local, opts, flavour, probe.unit_count)
    if world.is_main:
        split = " | ".join(f"{g}:{names[grp[0]]}..{names[grp[-1]]}" for g, grp in enumerate(groups))
        print(f"hpctrain: pipeline pp={p} dp={dp.size} schedule={opts.schedule} "
              f"microbatches={opts.microbatches} chunks/rank={v} dp_sharding={flavour} "
              f"p2p={'ordered' if ordered else 'eager'} "
              f"stages {split}", flush=True)
    return root, executor
