"""What the planner knows about a model, read on the meta device (no weights, no memory).

A ``ModelShape`` is the model as pipeline layers (the unit a stage holds): the tensors each
layer builds, which layers are blocks (sharding units, checkpointed under activation
checkpointing) and the bytes each saves for backward per sample. A GPT described by size
(``gpt_shape``) is priced with the analytic formulas of estimate.py; any other model
(built-in, ``package.module:factory``, an nn.Sequential) by a forward pass of one sample on
the meta device, counting what autograd saves (saved.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from hpctrain.models.chain import split_model
from hpctrain.models.layers import LayerStack, PipeLayer, from_sequential
from hpctrain.plan.saved import SavedTensorMeter

__all__ = ["GPTDims", "LayerInfo", "ModelShape", "ShapeError", "gpt_shape", "shape_of",
           "stack_shape"]


class ShapeError(ValueError):
    """The model or its description cannot be built; the message says which value and why."""


@dataclass(frozen=True)
class GPTDims:
    """A GPT-style decoder by size (the built-in gpt's options: d_model = hidden)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int

    def model_options(self) -> dict:
        return {"layers": self.layers, "d_model": self.hidden, "heads": self.heads,
                "vocab": self.vocab, "seq_len": self.seq}


@dataclass
class LayerInfo:
    """One pipeline layer: {parameter path: shape} it builds, whether it is a block, and
    (models priced by a meta forward) per sample in fp32: {storage: bytes} it saves for
    backward (storages, so a tensor two layers save counts once in a stage holding both),
    its input's and output's bytes, and what its loss saves (the last layer)."""

    name: str
    tensors: dict
    is_block: bool
    saved: dict = field(default_factory=dict)
    input_bytes: float = 0.0
    output_bytes: float = 0.0
    loss_saved: dict = field(default_factory=dict)
    # blocks nested inside a layer that is not one (a user's whole model as one layer):
    # (parameters, bytes saved, input bytes) per sample each, for units and checkpointing
    inner_blocks: list = field(default_factory=list)


@dataclass
class ModelShape:
    """The model as layers; ``spec``/``options`` spell it for ``hpctrain train``."""

    spec: str
    options: dict
    layers: list
    tied: dict = field(default_factory=dict)
    tp_plan: dict = field(default_factory=dict)
    stack: LayerStack | None = None
    gpt: GPTDims | None = None
    pipelinable: bool = True
    _splits: dict = field(default_factory=dict, repr=False)
    # (sample, target, loss_fn, whole) of the meta forward that priced ``layers``, to price
    # a tensor-parallel rank's share again (None: priced by formula, the gpt)
    _forward: tuple | None = field(default=None, repr=False)
    _at_tp: dict = field(default_factory=dict, repr=False)

    def layers_at(self, tp: int) -> list:
        """``layers`` as one rank of a tp split saves them (a meta forward of rank 0's
        split, the largest); ``layers`` itself at tp = 1 or for a model priced by formula."""
        if tp == 1 or self._forward is None:
            return self.layers
        if tp not in self._at_tp:
            from hpctrain.parallel.tensor import split_for_pricing

            sample, target, loss_fn, whole = self._forward
            infos = _tensors(self.stack, whole)
            _meta_forward(self.stack, infos, sample, target, loss_fn,
                          split=lambda root: split_for_pricing(root, self.stack, tp))
            self._at_tp[tp] = infos
        return self._at_tp[tp]

    def tp_splits(self, tp: int) -> dict:
        """{parameter path: Split} the model's tensor-parallel plan cuts at degree tp
        (parallel/tensor's own check; ValueError when the plan cannot run at tp)."""
        if tp not in self._splits:
            from hpctrain.parallel.tensor import check

            try:
                self._splits[tp] = check(self.stack, None, tp)[1]
            except ValueError as exc:
                self._splits[tp] = exc
        if isinstance(self._splits[tp], ValueError):
            raise self._splits[tp]
        return self._splits[tp]

    def params(self, indices=None, splits=None, tp: int = 1) -> int:
        """Parameters held by a rank holding layers ``indices`` (all: the whole model), each
        tied tensor once per stage holding it, each tensor in ``splits`` cut in tp parts."""
        indices = range(len(self.layers)) if indices is None else indices
        held = {path: shape for i in indices for path, shape in self.layers[i].tensors.items()}
        total = 0
        for path, shape in held.items():
            if self.tied.get(path) in held:
                continue  # the alias shares its owner's storage
            n = math.prod(shape)
            split = splits.get(path) if splits else None
            if split is not None and split.padded:  # a padded vocabulary: the most a rank holds
                total += -(-split.padded // tp) * (n // split.padded)
            else:
                total += n // tp if split is not None else n
        return total

    def units(self, indices=None, splits=None, tp: int = 1) -> list:
        """Sharding units (the 'blocks' policy): one per block layer, one for the rest."""
        indices = list(range(len(self.layers)) if indices is None else indices)
        blocks = [i for i in indices if self.layers[i].is_block]
        rest = [i for i in indices if not self.layers[i].is_block]
        out = [self.params([i], splits, tp) for i in blocks]
        inner = [b[0] for i in rest for b in self.layers[i].inner_blocks]
        remainder = self.params(rest, splits, tp) - sum(inner)
        return out + inner + ([remainder] if rest and remainder else [])


def gpt_shape(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> ModelShape:
    """The built-in gpt at this size, its tensors read on the meta device."""
    from hpctrain.models.gpt import GPT, gpt_layers

    for name, v in (("layers", layers), ("hidden", hidden), ("heads", heads),
                    ("vocab", vocab), ("seq", seq)):
        if not isinstance(v, int) or v < 1:
            raise ShapeError(f"--{name} {v!r}: expected a positive integer")
    if hidden % heads:
        raise ShapeError(f"--hidden {hidden} is not divisible by --heads {heads}: each head "
                         f"needs hidden/heads channels; pick heads dividing {hidden}")
    dims = GPTDims(layers, hidden, heads, vocab, seq)
    stack = gpt_layers(vocab, hidden, heads, layers, seq)
    with torch.device("meta"):
        whole = GPT(vocab, hidden, heads, layers, seq)
    infos = _tensors(stack, whole)
    return ModelShape("gpt", dims.model_options(), infos, dict(stack.tied),
                      _declared_plan(stack), stack, dims)


def stack_shape(spec: str, options: dict, stack: LayerStack, sample, target=None,
                loss_fn=None, pipelinable: bool = True, whole: nn.Module | None = None
                ) -> ModelShape:
    """A model given as layers, priced by a meta forward of one sample (and its loss);
    ``whole``: the model the layers came from, where its blocks are found (an
    nn.Sequential's repeated children), when not the stack's own modules."""
    infos = _tensors(stack, whole)
    _meta_forward(stack, infos, sample, target, loss_fn)
    return ModelShape(spec, options, infos, dict(stack.tied), _declared_plan(stack), stack,
                      pipelinable=pipelinable, _forward=(sample, target, loss_fn, whole))


def _declared_plan(stack: LayerStack) -> dict:
    """The tensor-parallel plan the model declares: the stack's, or that of the model it was
    split from (a Hugging Face model's own, GPT-2's from parallel/tensor); {} if none."""
    from hpctrain.parallel.tensor import model_plan

    try:
        return model_plan(stack)
    except ValueError:  # a plan hpctrain cannot run: no tensor-parallel plans to offer
        return {}


def shape_of(spec: str, options: dict | None = None) -> ModelShape:
    """A built-in name or 'package.module:factory' as a ModelShape (ShapeError if not)."""
    from hpctrain.models import gpt, registry

    options = dict(options or {})
    try:
        if spec == "gpt":
            o = {**gpt.DEFAULTS, **options}
            return gpt_shape(o["layers"], o["d_model"], o["heads"], o["vocab"], o["seq_len"])
        if ":" not in spec and spec in registry.BUILTIN and spec != "unet":
            built = registry.build_layers(spec, 0, **options)
            x, y = built.dataset[0]
            whole = registry.build(spec, 0, **options).model  # a small built-in: real
            return stack_shape(spec, options, built.model, x.unsqueeze(0), y.unsqueeze(0),
                               built.loss_fn, whole=whole)
        built = registry.build(spec, 0, **options)
    except ShapeError:
        raise
    except (ValueError, TypeError, ImportError) as exc:
        raise ShapeError(str(exc)) from None
    x, y = built.dataset[0]
    model = built.model
    if isinstance(model, nn.Sequential):
        return stack_shape(spec, options, from_sequential(model), x.unsqueeze(0),
                           y.unsqueeze(0), built.loss_fn, whole=model)
    sample, target = x.unsqueeze(0), y.unsqueeze(0)
    try:  # a chain (Hugging Face GPT-2/Llama, embeddings -> blocks -> head): its layers
        stack = split_model(model, torch.stack([torch.as_tensor(x)] * 2))
    except TypeError:
        stack = None
    try:
        if stack is not None:
            return stack_shape(spec, options, stack, sample, target, built.loss_fn,
                               whole=model)
        # One layer: the whole model (no pipeline split), its blocks found inside it.
        whole = LayerStack([PipeLayer("model", lambda: {"model": model},
                                      lambda root, inp: root.model(inp))])
        return stack_shape(spec, options, whole, sample, target, built.loss_fn,
                           pipelinable=False)
    except (RuntimeError, NotImplementedError) as exc:  # e.g. .item() in the forward
        raise ShapeError(f"{spec}: its forward does not run on the meta device, where the "
                         f"plan prices activations ({type(exc).__name__}: {exc}); describe it "
                         f"as a models.layers.LayerStack or an nn.Sequential") from None


def _tensors(stack: LayerStack, whole: nn.Module | None = None) -> list:
    """Per layer: {parameter path: shape} built on the meta device, and whether the layer
    is a block (a ModuleList element or an nn.Sequential's repeated child)."""
    from hpctrain.models.structure import find_blocks

    if whole is None:
        with torch.device("meta"):
            whole = stack.build(range(len(stack)))
    blocks = {path for path, _ in find_blocks(whole)}
    out = []
    for layer in stack.layers:
        with torch.device("meta"):
            mods = layer.build()
        tensors = {f"{path}.{n}": tuple(p.shape) for path, m in mods.items()
                   for n, p in m.named_parameters()}
        out.append(LayerInfo(layer.name, tensors, is_block=bool(set(mods) & blocks)))
    return out


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _meta_forward(stack: LayerStack, infos: list, sample, target, loss_fn,
                  split=None) -> None:
    """Fill act/input/output bytes per sample with a forward of one sample on meta
    (``split``: root -> root as one rank of a model-parallel split holds it)."""
    with torch.device("meta"):
        root = stack.build(range(len(stack)))
    if any(p.device.type != "meta" for p in root.parameters()):
        # layers of an already built model (from_sequential): price a meta copy of it
        root = copy.deepcopy(root).to("meta")
    if split is not None:
        root = split(root)
    params = list(root.parameters())
    x = _to_meta(sample)
    if x.is_floating_point():
        x.requires_grad_(True)
    meters = []  # alive together: meta storages are told apart by their live bases
    for layer, info in zip(stack.layers, infos):
        info.input_bytes = _nbytes(x)
        meters.append(SavedTensorMeter(lambda: params))
        with meters[-1], _inner_blocks(root, layer, info, meters[-1]):
            x = layer.forward(root, x)
        info.saved, info.output_bytes = dict(meters[-1].seen), float(_nbytes(x))
    if loss_fn is not None and target is not None:
        meters.append(SavedTensorMeter(lambda: params))
        with meters[-1]:
            loss_fn(x, _to_meta(target))
        infos[-1].loss_saved = dict(meters[-1].seen)


@contextlib.contextmanager
def _inner_blocks(root: nn.Module, layer, info: LayerInfo, meter: SavedTensorMeter):
    """Record (params, saved bytes, input bytes) of the blocks inside a layer that is not
    a block itself, from hooks around each block's forward."""
    from hpctrain.models.structure import find_blocks

    if info.is_block:
        yield
        return
    paths = [p.split(".", 1)[0] for p in _layer_paths(layer, root)]
    blocks = [m for path in paths for _, m in find_blocks(root.get_submodule(path))]
    before, handles = {}, []

    def pre(module, args):
        before[id(module)] = set(meter.seen)

    def post(module, args, out):
        new = sum(b for k, b in meter.seen.items() if k not in before[id(module)])
        info.inner_blocks.append((sum(p.numel() for p in module.parameters()), float(new),
                                  float(_nbytes(args[0]) if args else 0)))

    for m in blocks:
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _layer_paths(layer, root: nn.Module) -> list:
    """The top-level module names a layer builds (its modules mounted under root)."""
    with torch.device("meta"):
        return [path for path in layer.build() if path.split(".", 1)[0] in root._modules]


def _to_meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")
