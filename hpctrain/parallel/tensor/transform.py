"""The tensor-parallel transform: split the layers a plan names over the mesh's tp group.

Each matched module gets this rank's slice of its weights and a forward that communicates
as Megatron-LM's (layers.py); every parameter gets its placement (placement.py): a slice of
the global tensor (``offset``, sliced over tp) or a replicated copy over tp whose gradient
is partial under sequence parallel (the module ran on a sequence chunk) or already equal.
The dp flavour applied next reads those placements to sum, norm, clip and checkpoint.

A whole nn.Module is split in place; a LayerStack (the pipeline builds its stages lazily)
gets layers whose ``build`` splits what they build, so each stage is born tensor-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from hpctrain.models.dropout import Dropout
from hpctrain.models.layers import LayerStack, PipeLayer
from hpctrain.parallel.placement import Copies, Placement, place, placement_of
from hpctrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                             SequenceSplitEmbedding, VocabParallelEmbedding,
                                             swap_class)
from hpctrain.parallel.tensor.loss import is_cross_entropy, vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.styles import match_plan, parse_plan

__all__ = ["TensorOptions", "TensorParallel", "check", "prepare"]

_NEEDS = {"colwise": nn.Linear, "vocab_head": nn.Linear, "rowwise": nn.Linear,
          "vocab_embedding": nn.Embedding, "attention_dropout": Dropout}
_NEED_NAMES = {nn.Linear: "torch.nn.Linear", nn.Embedding: "torch.nn.Embedding",
               Dropout: "hpctrain.models.dropout.Dropout"}


@dataclass(frozen=True)
class TensorOptions:
    """[tensor]: sequence parallel on/off and a plan overriding the model's own."""

    sequence_parallel: bool = False
    plan: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Split:
    """How a parameter is cut over tp: along ``dim``, in ``parts`` equal parts cut alike."""

    dim: int
    parts: int = 1


class TensorParallel:
    """What the run needs to know after the split: the tp group, which state_dict keys are
    slices and how (``splits``), and the vocabulary slice of the output head (the loss).
    As the executor of a tp x dp run it also says which samples this rank reads."""

    def __init__(self, tp, sequence_parallel: bool, splits: dict, vocab: int | None,
                 dp_rank: int, dp_size: int):
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.splits, self.vocab = splits, vocab
        self.dp_rank, self.dp_size = dp_rank, dp_size

    # -- the loss and the reported loss --
    def adapt_loss(self, loss_fn):
        """The loss to run on this rank's logits (vocab-parallel cross-entropy when the
        head's vocabulary is split; ``check`` has made sure loss_fn is a cross-entropy)."""
        if self.vocab is None:
            return loss_fn
        if not is_cross_entropy(loss_fn):
            raise ValueError(f"tensor parallel: loss {loss_fn!r} cannot run on "
                             f"vocabulary-parallel logits (see transform.check)")
        tp, start = self.tp, self.tp.rank * (self.vocab // self.tp.size)
        return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp, start)

    # -- executor of a tp x dp run (the pipeline is the executor under pp) --
    def data_shard(self, world) -> tuple[int, int]:
        """The tp ranks of a replica read the same samples (local)."""
        return self.dp_rank, self.dp_size

    def load_batch(self, dataset, indices):
        from hpctrain.data.sampler import collate

        return collate(dataset, indices)

    def forward_backward(self, dp_part, micro_batches, loss_fn, precision) -> float:
        local = 0.0
        for x, y, weight in micro_batches:
            with precision.autocast():
                loss = loss_fn(dp_part.model(x), y)
            dp_part.backward(precision.scale(loss * weight))
            local += float(loss.detach()) * weight
        return local

    # -- whole tensors --
    def assemble(self, state: dict) -> dict:
        """state with every tp slice replaced by the whole tensor (collective over tp;
        every tp rank passes the same keys in the same order)."""
        out = {}
        done = {}
        for key, t in state.items():
            split = self.splits.get(key)
            if split is None or not torch.is_tensor(t):
                out[key] = t
                continue
            if id(t) not in done:
                done[id(t)] = _assemble(t, split, self.tp)
            out[key] = done[id(t)]
        return out


def _assemble(t: torch.Tensor, split: Split, tp) -> torch.Tensor:
    pieces = tp.allgather(t.detach().reshape(1, -1).contiguous())
    d, shape = split.dim, tuple(t.shape)
    per = shape[d] // split.parts
    parts = [p.reshape(shape[:d] + (split.parts, per) + shape[d + 1:]) for p in pieces]
    whole = torch.cat(parts, dim=d + 1)
    return whole.reshape(shape[:d] + (shape[d] * tp.size,) + shape[d + 1:])


# -- checking the plan against the model (pure: no communication) --

def _skeleton(model) -> nn.Module:
    if isinstance(model, LayerStack):
        with torch.device("meta"):
            return model.build(range(len(model)))
    return model


def _check(name: str, module: nn.Module, style, n: int) -> None:
    need = _NEEDS.get(style.kind)
    if need is not None and not isinstance(module, need):
        raise ValueError(f"tensor plan: style {style.kind} applies to {_NEED_NAMES[need]}, "
                         f"but module {name!r} is a {type(module).__name__}; give it another "
                         f"style or none")
    where = f"tensor parallel over tp={n}: module {name!r} ({style.kind})"
    if style.kind in ("colwise", "vocab_head"):
        out = module.out_features
        if out % style.parts or (out // style.parts) % n:
            what = f"{out} output features" if style.parts == 1 else \
                f"{out // style.parts} output features per part ({style.parts} parts)"
            raise ValueError(f"{where}: {what} do not split over tp={n}; use sizes divisible "
                             f"by tp")
        if style.heads and style.heads % n:
            raise ValueError(f"{where}: {style.heads} attention heads do not split over "
                             f"tp={n}; use a head count divisible by tp")
    elif style.kind == "rowwise" and module.in_features % n:
        raise ValueError(f"{where}: {module.in_features} input features do not split over "
                         f"tp={n}; use sizes divisible by tp")
    elif style.kind == "vocab_embedding":
        if module.num_embeddings % n:
            raise ValueError(f"{where}: a vocabulary of {module.num_embeddings} does not split "
                             f"over tp={n}; use a vocabulary size divisible by tp (e.g. "
                             f"{-(-module.num_embeddings // n) * n})")
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(f"{where}: padding_idx/max_norm embeddings cannot be split")
    elif style.kind in ("sequence_parallel", "attention_dropout"):
        if isinstance(module, nn.Dropout) and module.p > 0:
            raise ValueError(f"{where}: torch's nn.Dropout draws masks that depend on the "
                             f"split; use hpctrain.models.dropout.Dropout")


def _splits(skeleton: nn.Module, styles: dict) -> tuple[dict, int | None]:
    """{state_dict key: Split} of every sliced parameter (aliases of a tied one included)
    and the vocabulary size of a vocab_head (None: none); ValueError for a parameter that
    two styles would cut differently."""
    by_param: dict = {}
    vocab = None
    for name, module in skeleton.named_modules():
        style = styles.get(name)
        if style is None:
            continue
        cuts = {"colwise": ((0, style.parts), (0, style.parts)), "vocab_head": ((0, 1), (0, 1)),
                "rowwise": ((1, 1), None), "vocab_embedding": ((0, 1), None)}.get(style.kind)
        if cuts is None:
            continue
        if style.kind == "vocab_head":
            vocab = module.out_features
        for pname, cut in zip(("weight", "bias"), cuts):
            p = getattr(module, pname, None)
            if p is None or cut is None:
                continue
            split = Split(*cut)
            old = by_param.setdefault(id(p), (split, f"{name}.{pname}"))
            if old[0] != split:
                raise ValueError(f"tensor plan: parameter {name}.{pname} is tied to {old[1]} "
                                 f"but their styles cut it differently; give the tied modules "
                                 f"matching styles (vocab_embedding with vocab_head)")
    splits = {}
    for key, t in skeleton.state_dict(keep_vars=True).items():
        if id(t) in by_param:
            splits[key] = by_param[id(t)][0]
    return splits, vocab


# -- splitting --

def _slice_param(module, pname: str, split: Split, tp, cache: dict) -> None:
    p = getattr(module, pname)
    if id(p) in cache:  # a tied parameter already cut: share the slice
        setattr(module, pname, cache[id(p)])
        return
    r, n, d = tp.rank, tp.size, split.dim
    shape = tuple(p.shape)
    per = shape[d] // split.parts
    c = per // n
    viewed = shape[:d] + (split.parts, per) + shape[d + 1:]
    local = p.detach().reshape(viewed).narrow(d + 1, r * c, c)
    local_shape = shape[:d] + (split.parts * c,) + shape[d + 1:]
    new = nn.Parameter(local.reshape(local_shape).clone(), requires_grad=p.requires_grad)
    tp_group = (Copies("tp", tp, partial=False),)
    if split.parts == 1:
        offset = tuple(r * c if i == d else 0 for i in range(len(shape)))
        place(new, Placement(shape, offset, sliced_over=tp_group))
    else:
        count = shape[:d] + (split.parts, c) + shape[d + 1:]
        offset = tuple(r * c if i == d + 1 else 0 for i in range(len(viewed)))
        place(new, Placement(shape, offset, sliced_over=tp_group, view=(viewed, count)))
    cache[id(p)] = new
    setattr(module, pname, new)


def _replicated(module: nn.Module, tp, partial: bool) -> None:
    """Place module's own whole parameters as copies over tp (once)."""
    for t in module.parameters(recurse=False):
        p = placement_of(t)
        if p.offset is None and not any(c.name == "tp" for c in p.copies):
            place(t, p.with_copies(Copies("tp", tp, partial=partial)))


def _apply(root: nn.Module, styles: dict, tp, sp: bool, cache: dict, prefix: str = "") -> None:
    """Split the modules of root (mounted at ``prefix``) the styles name; place everything."""
    r, n = tp.rank, tp.size
    for local_name, module in root.named_modules(prefix=prefix):
        style = styles.get(local_name)
        kind = style.kind if style else None
        if kind in ("colwise", "vocab_head"):
            _slice_param(module, "weight", Split(0, style.parts), tp, cache)
            if module.bias is not None:
                _slice_param(module, "bias", Split(0, style.parts), tp, cache)
            swap_class(module, ColumnParallelLinear, tp=tp, sequence_parallel=sp)
        elif kind == "rowwise":
            _slice_param(module, "weight", Split(1), tp, cache)
            swap_class(module, RowParallelLinear, tp=tp, sequence_parallel=sp)
            _replicated(module, tp, partial=sp)  # the bias is added to sequence chunks
        elif kind == "vocab_embedding":
            _slice_param(module, "weight", Split(0), tp, cache)
            swap_class(module, VocabParallelEmbedding, tp=tp, sequence_parallel=sp,
                       vocab_start=r * module.weight.shape[0])
        elif kind == "sequence_parallel":
            _replicated(module, tp, partial=sp)
            if sp and isinstance(module, nn.Embedding):
                swap_class(module, SequenceSplitEmbedding, tp=tp)
            if sp and isinstance(module, Dropout):
                module.shards = module.shards + ((-2, r, n),)
        elif kind == "attention_dropout":
            module.shards = module.shards + ((1, r, n),)
        # whatever is left runs on whole activations, alike on every tp rank
        _replicated(module, tp, partial=False)
        for b in module.buffers(recurse=False):
            p = placement_of(b)
            if not any(c.name == "tp" for c in p.copies):
                place(b, p.with_copies(Copies("tp", tp, partial=False)))


def _stack(stack: LayerStack, styles: dict, tp, sp: bool) -> LayerStack:
    def wrap(layer: PipeLayer) -> PipeLayer:
        def build():
            mods = layer.build()
            cache: dict = {}
            for path, module in mods.items():
                _apply(module, styles, tp, sp, cache, prefix=path)
            return mods
        return replace(layer, build=build)

    return replace(stack, layers=[wrap(layer) for layer in stack.layers])


def check(model, options: TensorOptions | None, tp: int, loss_fn=None) -> tuple:
    """Check model's tensor-parallel plan at degree tp (and, given, that loss_fn can run on
    vocabulary-parallel logits); return (styles by module name, splits by state_dict key,
    vocabulary of a vocab_head or None). Pure: every rank raises the same ValueError, before
    any communication."""
    opts = options or TensorOptions()
    plan = opts.plan or getattr(model, "tp_plan", None) or {}
    if not plan:
        raise ValueError(f"tensor parallel (tp={tp}): the model {type(model).__name__} has no "
                         f"tensor-parallel plan; give one in [tensor.plan] (module-name "
                         f"patterns -> colwise, rowwise, vocab_embedding, vocab_head, "
                         f"sequence_parallel, attention_dropout) or use tp=1")
    skeleton = _skeleton(model)
    styles = match_plan(parse_plan(plan), [n for n, _ in skeleton.named_modules()])
    for name, module in skeleton.named_modules():
        if name in styles:
            _check(name, module, styles[name], tp)
    splits, vocab = _splits(skeleton, styles)
    if loss_fn is not None and vocab is not None and not is_cross_entropy(loss_fn):
        name = getattr(loss_fn, "__qualname__", repr(loss_fn))
        raise ValueError(
            f"tensor parallel: the model's output head is split over the vocabulary "
            f"(vocab_head), so the loss must be the cross-entropy over those logits; the loss "
            f"{name} is not marked as one. Mark a mean token cross-entropy with "
            f"`{name}.cross_entropy = True`, or give the head another style")
    return styles, splits, vocab


def prepare(model, world, mesh, options: TensorOptions | None = None):
    """Split model (an nn.Module, or a LayerStack for the pipeline) over ``mesh.comm("tp")``
    by its plan; return (model, TensorParallel). Every check runs before any communication
    and fails alike on every rank."""
    opts = options or TensorOptions()
    tp = mesh.comm("tp")
    styles, splits, vocab = check(model, opts, tp.size)
    sp = bool(opts.sequence_parallel)
    if isinstance(model, LayerStack):
        model = _stack(model, styles, tp, sp)
    else:
        model.to(world.device)
        _apply(model, styles, tp, sp, {})
    state = TensorParallel(tp, sp, splits, vocab, mesh.coords["dp"], mesh.size("dp"))
    return model, state
