"""The tensor-parallel transform: split the layers a plan names over the mesh's tp group.

Each matched module gets this rank's slice of its weights and a forward that communicates
as Megatron-LM's (layers.py); every parameter gets its placement (placement.py): a slice of
the global tensor (``offset``, sliced over tp) or a replicated copy over tp whose gradient
is partial under sequence parallel (the module ran on a sequence chunk) or already equal.
The dp flavour applied next reads those placements to sum, norm, clip and checkpoint. The
plan is checked first (checks.py); what the run needs afterwards is executor.py's.

A whole nn.Module is split in place; a LayerStack (the pipeline builds its stages lazily)
gets layers whose ``build`` splits what they build, so each stage is born tensor-parallel
(a stack split from a built model hands out that model's modules at every build: each is
split once).
"""

from __future__ import annotations

import weakref
from dataclasses import replace

from torch import nn

from hpctrain.models.dropout import Dropout
from hpctrain.models.layers import LayerStack, PipeLayer
from hpctrain.parallel.placement import Copies, Placement, place, placement_of
from hpctrain.parallel.tensor.checks import Split, TensorOptions, check, cuts, vocab_rows
from hpctrain.parallel.tensor.executor import TensorParallel
from hpctrain.parallel.deferred import is_placeholder, sliced_placeholder, to_device
from hpctrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                             SequenceSplitEmbedding, VocabParallelEmbedding,
                                             column_conv1d, is_conv1d, row_conv1d,
                                             swap_class)

__all__ = ["prepare", "split_for_pricing"]


def _slice_param(module, pname: str, split: Split, tp, cache: dict) -> None:
    p = getattr(module, pname)
    if id(p) in cache:  # a tied parameter already cut: share the slice
        setattr(module, pname, cache[id(p)])
        return
    r, n, d = tp.rank, tp.size, split.dim
    shape = tuple(p.shape)
    per = shape[d] // split.parts
    first, c = split.rows(r, n, per)  # a padded vocabulary: the last rank may hold fewer
    viewed = shape[:d] + (split.parts, per) + shape[d + 1:]
    local_shape = shape[:d] + (split.parts * c,) + shape[d + 1:]
    tp_group = (Copies("tp", tp, partial=False),)
    if split.parts == 1:
        offset = tuple(first if i == d else 0 for i in range(len(shape)))
        placement = Placement(shape, offset, sliced_over=tp_group)
    else:
        count = shape[:d] + (split.parts, c) + shape[d + 1:]
        offset = tuple(first if i == d + 1 else 0 for i in range(len(viewed)))
        placement = Placement(shape, offset, sliced_over=tp_group, view=(viewed, count))
    if is_placeholder(p):  # deferred init: cut the placeholder; the values come when kept
        new = sliced_placeholder(p, local_shape, placement)
    else:
        local = p.detach().reshape(viewed).narrow(d + 1, first, c)
        new = nn.Parameter(local.reshape(local_shape).clone(), requires_grad=p.requires_grad)
        place(new, placement)
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
        for pname, split in (cuts(style, module, n) if style else {}).items():
            if getattr(module, pname, None) is not None:
                _slice_param(module, pname, split, tp, cache)
        if kind in ("colwise", "vocab_head"):
            cls = column_conv1d(module) if is_conv1d(module) else ColumnParallelLinear
            swap_class(module, cls, tp=tp, sequence_parallel=sp)
        elif kind == "rowwise":
            cls = row_conv1d(module) if is_conv1d(module) else RowParallelLinear
            swap_class(module, cls, tp=tp, sequence_parallel=sp)
            _replicated(module, tp, partial=sp)  # the bias is added to sequence chunks
        elif kind == "vocab_embedding":
            swap_class(module, VocabParallelEmbedding, tp=tp, sequence_parallel=sp,
                       vocab_start=min(r * vocab_rows(module.num_embeddings, n),
                                       module.num_embeddings))
        elif kind == "sequence_parallel":
            _replicated(module, tp, partial=sp)
            if sp and isinstance(module, nn.Embedding):
                swap_class(module, SequenceSplitEmbedding, tp=tp)
            if sp and isinstance(module, Dropout):
                module.shards = module.shards + ((-2, r, n),)
        elif kind == "attention_dropout":
            module.shards = module.shards + ((1, r, n),)
        elif kind == "per_rank":  # e.g. an attention's heads: this rank's share
            for attr in style.divide:
                setattr(module, attr, getattr(module, attr) // n)
        # whatever is left runs on whole activations, alike on every tp rank
        _replicated(module, tp, partial=False)
        for b in module.buffers(recurse=False):
            p = placement_of(b)
            if not any(c.name == "tp" for c in p.copies):
                place(b, p.with_copies(Copies("tp", tp, partial=False)))


def _stack(stack: LayerStack, styles: dict, tp, sp: bool) -> LayerStack:
    # A stack split from a built model (models/chain.py) returns the model's own modules
    # at every build (param counts, the stage, the checkpoint skeleton): split each once.
    done = weakref.WeakSet()

    def wrap(layer: PipeLayer) -> PipeLayer:
        def build():
            mods = layer.build()
            cache: dict = {}
            for path, module in mods.items():
                if module not in done:
                    _apply(module, styles, tp, sp, cache, prefix=path)
                    done.add(module)
            return mods
        return replace(layer, build=build)

    return replace(stack, layers=[wrap(layer) for layer in stack.layers])


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
        to_device(model, world.device)
        _apply(model, styles, tp, sp, {})
    state = TensorParallel(tp, sp, splits, vocab, mesh.coords["dp"], mesh.size("dp"))
    return model, state


class _Alone:
    """Rank 0 of a tp group of ``size`` whose collectives are identities: the split's shapes
    without communication."""

    rank = 0

    def __init__(self, size: int):
        self.size = size

    def allreduce(self, t, op="sum"):
        return t


def split_for_pricing(root: nn.Module, model, tp: int) -> nn.Module:
    """Split root (a meta-device build of ``model``'s layers) in place as tp rank 0 holds it
    (the largest share of a padded vocabulary), its collectives identities: what one rank's
    forward saves, for the planner. ValueError as ``check``'s."""
    styles = check(model, None, tp)[0]
    _apply(root, styles, _Alone(tp), False, {})
    return root
