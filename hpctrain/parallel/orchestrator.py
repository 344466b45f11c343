"""The orchestrator: a ParallelPlan in, one Parallelized out, transforms in a fixed order.

1. model-parallel transforms, in the registry's order: tensor parallel (Megatron layers
   over tp), domain layers, and any other dimension's own transform (Dimension.transform);
2. activation checkpointing (per block; per layer inside the pipeline);
3. the pipeline split (this rank keeps its stages);
4. the data-parallel flavour (ddp, zero1-3, fsdp) over the dp replicas, summing gradients
   over the groups the parameters' placements (placement.py) name: what the model-parallel
   transforms recorded when they split or copied them.

Rank 0 logs one line per transform applied and the group it works over. The trainer, the
checkpoint package and the CLI see only the plan and what this returns; a transform never
imports another one, this module is where they meet.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from hpctrain import registry
from hpctrain.data.sampler import collate
from hpctrain.data.structure import to_device
from hpctrain.errors import UsageError
from hpctrain.models.layers import LayerStack
from hpctrain.parallel.base import DPGroups
from hpctrain.parallel.executor import Executor
from hpctrain.parallel.deferred import Materializer, has_placeholders, materialize, placeholders
from hpctrain.parallel.plan import ParallelPlan

__all__ = ["apply_plan", "defer_init", "has_deferred", "Composed", "RunData"]


@dataclass(frozen=True)
class RunData:
    """What the run hands ``apply_plan`` beside the model, for the transforms that look at
    the data before they split it (the pipeline: a micro-batch to time its layers on,
    pipeline.balance = "measured", or two samples to check a user module's split on): the
    data set, the samples of one micro-batch of the step (over all replicas), the loss, and
    ``unit_count``, target -> the units its loss is a mean over (train.loss_weight =
    "tokens"; None: a micro-batch's pieces count by their rows)."""

    dataset: object
    micro_batch: int = 1
    loss_fn: Callable | None = None
    unit_count: Callable | None = None


class Composed:
    """A data-parallel flavour's model (gradients, step, norms, optimizer) run by a
    model-parallel Executor (executor.py: forward/backward, which samples and which part of
    each this rank reads; for the pipeline also the whole model's checkpoint naming).

    It offers what the trainer and the checkpoint package call on a Parallelized, each
    member said here: the flavour's for the model's state and its step, the executor's for
    running the step. ``flavour`` and ``executor`` are the two parts."""

    def __init__(self, flavour, executor, name: str, tensor=None):
        if not isinstance(executor, Executor):
            raise TypeError(f"{type(executor).__name__} is not an Executor (parallel/"
                            f"executor.py): it lacks one of forward_backward, forward_loss, "
                            f"data_shard, load_batch")
        self.flavour = flavour
        self.executor = executor
        self._tensor = tensor  # the tensor-parallel split (its loss, its whole tensors)
        self.name = name

    # --- the flavour's: the model this rank keeps, its optimizer, gradients and step ---
    @property
    def model(self):
        return self.flavour.model

    @property
    def optimizer(self):
        return self.flavour.optimizer

    @property
    def job_comm(self):
        return self.flavour.job_comm

    @job_comm.setter
    def job_comm(self, comm) -> None:  # e.g. a counting wrapper over the job's collectives
        self.flavour.job_comm = comm

    @property
    def dp_copies(self) -> tuple:
        return self.flavour.dp_copies

    def backward(self, loss) -> None:
        self.flavour.backward(loss)

    def step(self, scaler=None, max_grad_norm: float = 0.0, guard=None) -> bool:
        return self.flavour.step(scaler, max_grad_norm, guard)

    def param_norm(self) -> float:
        return self.flavour.param_norm()

    def buffer_norm(self) -> float:
        return self.flavour.buffer_norm()

    def placements(self) -> dict:
        return self.flavour.placements()

    def load_state_entries(self, reader) -> None:
        self.flavour.load_state_entries(reader)

    # what the non-finite guard and the device step read (train/nonfinite.py,
    # train/device_step.py)
    def _grad_norm(self) -> float:
        return self.flavour._grad_norm()

    def _nonfinite_grads(self):
        return self.flavour._nonfinite_grads()

    def _norm_weight(self, t) -> float:
        return self.flavour._norm_weight(t)

    # --- the executor's: running the step over the split ---
    @property
    def name_of(self):
        """A stage parameter's name in the whole model (the pipeline's), else None."""
        return getattr(self.executor, "name_of", None)

    def forward_backward(self, micro_batches, loss_fn, precision) -> float:
        """Run the executor over the step's micro-batches (collective). Under tensor
        parallel the loss runs on vocabulary-parallel logits, and one rank of each tp group
        reports it (every tp rank computed the same loss)."""
        if self._tensor is not None:
            loss_fn = self._tensor.adapt_loss(loss_fn)
        local = self.executor.forward_backward(self.flavour, micro_batches, loss_fn, precision)
        return local if self._tensor is None or self._tensor.tp.rank == 0 else 0.0

    def forward_loss(self, micro_batches, loss_fn, precision) -> float:
        """``forward_backward`` without the backward (evaluation; see Parallelized), run by
        the executor, reported as the training loss is (collective)."""
        if self._tensor is not None:
            loss_fn = self._tensor.adapt_loss(loss_fn)
        local = self.executor.forward_loss(self.flavour, micro_batches, loss_fn, precision)
        return local if self._tensor is None or self._tensor.tp.rank == 0 else 0.0

    def data_shard(self, world) -> tuple[int, int]:
        return self.executor.data_shard(world)

    def load_batch(self, dataset, indices):
        return self.executor.load_batch(dataset, indices)

    # --- both: the executor names the whole model where it has a hook, else the flavour ---
    def _by_executor(self, method: str, *args):
        fn = getattr(self.executor, method, None)
        return fn(self.flavour, *args) if fn is not None else getattr(self.flavour, method)(*args)

    def state_entries(self) -> list:
        return self._by_executor("state_entries")

    def state_meta(self) -> dict:
        return self._by_executor("state_meta")

    def memory_report(self) -> dict:
        report = {**self._by_executor("memory_report"), "strategy": self.name}
        if self._tensor is not None:  # the bytes are this rank's tp slices
            report.update(tp=self._tensor.tp.size,
                          sequence_parallel=self._tensor.sequence_parallel)
        return report

    def full_state_dict(self, rank0_only: bool = False) -> dict:
        """As Parallelized.full_state_dict, the executor assembling the whole model (and
        the tp slices joined into whole tensors)."""
        if not hasattr(self.executor, "full_state"):
            state = self.flavour.full_state_dict(False)
        else:
            state = self.executor.full_state(self.flavour)
        if self._tensor is not None:
            state = self._tensor.assemble(state)
        job = self.flavour.job_comm
        if job is not None:
            job.barrier()
        if rank0_only and job is not None and job.rank != 0:
            return {}
        return state


def _log(world, text: str) -> None:
    if world.is_main:
        print(f"hpctrain: {text}", flush=True)


def _ranks(comm) -> str:
    return f"groups of {comm.size} rank{'s' if comm.size != 1 else ''}"


def horovod_available() -> bool:
    """Whether Horovod's torch module imports here (GPU images often ship without it)."""
    global _HOROVOD
    if _HOROVOD is None:
        try:
            importlib.import_module("horovod.torch")
            _HOROVOD = True
        except ImportError:
            _HOROVOD = False
    return _HOROVOD


_HOROVOD: bool | None = None


def _flavour(plan: ParallelPlan, model, make_optimizer, world, options: dict, groups: DPGroups,
             **layout):
    """Apply the plan's dp flavour. Under pipeline stages Horovod (which reduces over the
    whole job) cannot carry ``ddp``: the stages' replicas are then all-reduced by the
    sharding engine unsharded (NO_SHARD), and BatchNorm keeps per-stage statistics."""
    from dataclasses import replace

    flavour = plan.flavour
    no_horovod = flavour == "ddp" and not horovod_available()
    if no_horovod:
        if options.get("ddp") is not None and options["ddp"].fp16_compression:
            raise UsageError("ddp.fp16_compression needs Horovod, which is not installed "
                             "here; install it (make setup) or drop --fp16-compression")
        _log(world, "Horovod is not installed: the ddp flavour runs on hpctrain's own "
                    "all-reduce (the sharding engine unsharded, NO_SHARD), with the same "
                    "results; install Horovod for its tensor fusion")
    if registry.ddp_by_engine(plan) or no_horovod:
        from hpctrain.parallel.fsdp import FSDPOptions

        ddp = options.get("ddp")
        options = {**options, "fsdp": FSDPOptions(
            sharding_strategy="NO_SHARD", grad_accum=ddp.grad_accum if ddp else 1)}
        flavour = "fsdp"
    spec = registry.flavour(flavour)
    module = importlib.import_module(spec.module)
    opts = options.get(spec.table)
    if hasattr(module, "options_for"):
        opts = module.options_for(flavour, opts)
    if plan.pipeline:  # BatchNorm statistics stay per stage (micro-batches, not replicas)
        # options_for always gives zero its options; only fsdp may come without any
        opts = replace(opts, sync_batchnorm=False) if opts is not None else \
            module.FSDPOptions(sync_batchnorm=False)
    return module.wrap(model, make_optimizer, world, opts, groups=groups, **layout)


def apply_plan(plan: ParallelPlan, model, make_optimizer, world, options: dict | None = None,
                activation_checkpointing: bool = False, data: RunData | None = None):
    """Apply the plan's transforms to model (a LayerStack or nn.Sequential when the plan has
    a pipeline) and return the Parallelized (collective over the world).

    ``options``: typed options per config table ({"ddp": DDPOptions, "zero": ZeroOptions,
    "fsdp": FSDPOptions, "pipeline": PipelineOptions, "domain": DomainOptions, ...}); missing
    ones take their defaults. ``data``: the run's data (RunData), which the pipeline
    probes.
    """
    options = dict(options or {})
    if plan.world_size != world.size:
        raise ValueError(f"plan {plan.describe()} is for {plan.world_size} ranks, the world "
                         f"has {world.size}")
    _log(world, f"plan {plan.describe()}")
    if plan.name == "single":
        from hpctrain.parallel import single

        if activation_checkpointing:
            _checkpoint(model, world)
        return single.wrap(model, make_optimizer, world)
    step, tensor, executor, groups = 1, None, None, DPGroups.of_world(world)
    for dim in registry.by_transform_order():  # the model-parallel transforms, in order
        if not plan.uses(dim.strategy):
            continue
        if dim.strategy == "pipeline":  # last: it applies the flavour to its stages
            return _pipeline(plan, model, make_optimizer, world, options,
                             activation_checkpointing, tensor, step, data)
        mesh = world.mesh(plan.layout)
        if dim.strategy == "tensor":
            model, tensor = _tensor(plan, model, world, options, step)
            executor = tensor
            # the tp ranks of a replica read the same samples
            groups = DPGroups(mesh.comm("dp"), (), mesh.comm("dp"))
        elif dim.strategy == "domain":
            from hpctrain.parallel.domain import executor as domain

            model, executor = domain.prepare(model, world, mesh, options.get("domain"))
            groups = DPGroups(mesh.comm("dp"), executor.partial_groups, world.comm)
            _log(world, f"transform {step}: domain: spatial layers split over dom="
                        f"{'x'.join(map(str, plan.dom))} ({_ranks(mesh.comm('dom'))}); weight "
                        f"gradients are partial over dom")
        else:
            model, executor, groups = _transform(dim, plan, model, world, mesh, options, step)
        step += 1
    if activation_checkpointing:
        n = _checkpoint(model, world)
        _log(world, f"transform {step}: activation checkpointing: {n} blocks recompute "
                    f"their activations in backward")
        step += 1
    par = _flavour(plan, model, make_optimizer, world, options, groups)
    sums = " x ".join([f"dp ({groups.dp.size})"] + [f"partial ({c.size})" for c in groups.partial])
    _log(world, f"transform {step}: {_flavour_text(plan)} over dp={groups.dp.size}; gradients "
                f"summed over {sums} ranks" + (" (and over tp where sequence parallel made "
                                              "them partial)" if tensor is not None and
                                              tensor.sequence_parallel else ""))
    materialize(model)  # deferred init: whatever no transform filled (none, normally)
    if executor is None:
        return par
    return Composed(par, executor, plan.name, tensor)


def defer_init(model, stack) -> int:
    """Deferred initialisation of ``model`` (built on the meta device from ``stack``, a
    LayerStack): its tensors become placeholders that the transforms fill only where a rank
    keeps them (parallel/deferred.py). Call before ``apply_plan``. Returns how many."""
    return placeholders(model, Materializer(stack))


def has_deferred(model) -> bool:
    """Whether ``model`` holds deferred-init placeholders (``defer_init``)."""
    return not isinstance(model, LayerStack) and has_placeholders(model)


def _flavour_text(plan: ParallelPlan) -> str:
    if registry.ddp_by_engine(plan):
        return "ddp (all-reduced by the sharding engine: Horovod reduces over the whole job)"
    return plan.flavour


def _tensor(plan: ParallelPlan, model, world, options: dict, step: int):
    """The tensor-parallel split of model over the mesh's tp groups."""
    from hpctrain.parallel.tensor import check_sharding, prepare

    mesh = world.mesh(plan.layout)
    model, tensor = prepare(model, world, mesh, options.get("tensor"))
    # the dp flavour applied next must shard the split alike on the tp ranks (pure: every
    # rank raises alike, before the flavour communicates)
    check_sharding(tensor.splits, plan.tp, plan.flavour, plan.dp)
    _log(world, f"transform {step}: tensor: {len(tensor.splits)} weights split over tp="
                f"{plan.tp} ({_ranks(mesh.comm('tp'))}); sequence parallel "
                f"{'on' if tensor.sequence_parallel else 'off'}; vocabulary-parallel loss "
                f"{'on' if tensor.vocab else 'off'}")
    return model, tensor


def _transform(dim, plan: ParallelPlan, model, world, mesh, options: dict, step: int):
    """Any other dimension: its registered transform (``Dimension.transform``,
    ``prepare(model, world, mesh, options) -> (model, executor)``) over its mesh key; the
    dp flavour then sums over dp and the groups the executor says its gradients are partial
    over (``partial_groups``, if it has any)."""
    module, _, name = dim.transform.partition(":")
    prepare = getattr(importlib.import_module(module), name)
    model, executor = prepare(model, world, mesh, options.get(dim.table))
    partial = getattr(executor, "partial_groups", ())
    _log(world, f"transform {step}: {dim.strategy}: {dim.noun} over {dim.key}="
                f"{plan.degree(dim.key)} ({_ranks(mesh.comm(dim.key))})")
    return model, executor, DPGroups(mesh.comm("dp"), partial)


def _checkpoint(model, world) -> int:
    from hpctrain.parallel.activation_checkpointing import checkpoint_blocks

    return checkpoint_blocks(model, is_main=world.is_main)


def _probe(opts, data: RunData | None, stack, world):
    """What the pipeline reads of the run's data (pipeline.Probe): a micro-batch's input
    and target on the device and the loss, to time the layers on (balance = "measured"),
    else a user module's two sample inputs on its device, to check its split against its
    forward; and how a target counts its loss's units."""
    from hpctrain.parallel.pipeline import Probe

    if data is None:
        return Probe()
    if opts.balance == "measured":
        n = data.micro_batch // opts.microbatches
        x, y = collate(data.dataset, range(max(1, n)))
        return Probe(to_device(x, world.device), to_device(y, world.device), data.loss_fn,
                     data.unit_count)
    if not isinstance(stack, LayerStack):  # a user's module (the Trainer's Python API)
        device = next(stack.parameters()).device
        x = collate(data.dataset, range(min(2, len(data.dataset))))[0]
        return Probe(to_device(x, device), unit_count=data.unit_count)
    return Probe(unit_count=data.unit_count)


def _pipeline(plan, stack, make_optimizer, world, options, activation_checkpointing,
              tensor=None, step=1, data: RunData | None = None):
    """The pipeline split, then the dp flavour over each stage's replicas, sharding the
    units the pipeline names (the parameters each set of its chunks uses)."""
    from dataclasses import replace

    from hpctrain.parallel.pipeline import PipelineOptions, prepare

    opts = options.get("pipeline") or PipelineOptions()
    opts = replace(opts, mesh=plan.layout, dp_sharding=plan.flavour,
                   activation_checkpointing=activation_checkpointing or opts.activation_checkpointing)
    root, executor = prepare(stack, world, opts, plan.flavour, _probe(opts, data, stack, world))
    _log(world, f"transform {step}: pipeline: {plan.pp} stages in each of {plan.dp} replicas; "
                f"activation recompute per layer: "
                f"{'on' if opts.activation_checkpointing else 'off'}")
    groups = DPGroups(executor.dp, (), executor.dp)
    par = _flavour(plan, root, make_optimizer, world, options, groups,
                   units=executor.unit_specs(), name_of=executor.name_of)
    _log(world, f"transform {step + 1}: {_flavour_text(plan)} over dp={executor.dp.size} for "
                f"each stage's {len(executor.unit_specs())} units")
    return Composed(par, executor, plan.name, tensor)
