"""Split an already built model whose forward is a chain into a LayerStack (pipeline stages).

A pipeline stage runs a contiguous run of layers, each taking and returning one tensor. An
nn.Sequential is such a chain by construction. Other models are recognised by structure:

- Hugging Face GPT-2 (``transformer.wte/wpe/drop/h/ln_f`` + ``lm_head``) and Llama
  (``model.embed_tokens/layers/norm/rotary_emb`` + ``lm_head``): small adapters whose layer
  forwards compute what the HF forward computes for ``input_ids`` (and ``attention_mask``)
  ``-> logits``: positions, the causal mask (with the padding mask, through HF's own
  ``create_causal_mask``) and Llama's rotary embeddings are recomputed in every stage from
  the hidden state's shape and the stage's copy of the batch, so only one tensor crosses a
  stage boundary.
- Anything of the form ``modules before -> one ModuleList of blocks -> modules after``,
  each module called with one tensor in registration order (the generic chain).

Layers hold the model's own modules at their paths in the model, so parameter names (and
checkpoints) are the model's, and weights shared by two layers are declared tied. Given a
sample input, the chain is checked against ``model(sample)`` so that a model whose forward
is not this chain fails with an error instead of training a different model.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from .layers import (LayerStack, PipeLayer, check_input, from_sequential, run_layer,
                     shared_parameters, split_input)

__all__ = ["split_model", "check_chain"]

_EXPECTED = ("an nn.Sequential, a Hugging Face GPT-2 or Llama causal LM, or a chain "
             "'embeddings -> one nn.ModuleList of blocks -> norm -> head' whose modules are "
             "registered in the order the forward calls them, each taking and returning one "
             "tensor")
# The inputs of a Hugging Face causal LM batch the GPT-2 and Llama stages take.
_HF_INPUTS = ("input_ids", "attention_mask")
_FIX = ("fix: express the model as an nn.Sequential of its layers, or describe it as a "
        "models.layers.LayerStack (one PipeLayer per layer, whose forward says how the layer "
        "is called); pipeline.split_points then chooses where stages start")


def split_model(model: nn.Module, sample: torch.Tensor | None = None) -> LayerStack:
    """The layers of an already built model whose forward is a chain (see the module doc);
    with ``sample`` (one batch of inputs) the chain is checked against ``model(sample)``
    (the generic chain needs one). TypeError naming what is expected for any other model."""
    if isinstance(model, nn.Sequential):
        return from_sequential(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"pipeline splitting takes an nn.Module, got {type(model).__name__}; "
                        f"{_FIX}")
    for recognises, layers_of in _ARCHITECTURES:
        if recognises(model):
            inputs = () if layers_of is _generic_layers else _HF_INPUTS
            stack = LayerStack(layers_of(model), tied=shared_parameters(model), inputs=inputs,
                               source=model)
            break
    else:
        raise TypeError(f"cannot split {type(model).__name__} into pipeline layers: expected "
                        f"{_EXPECTED}; {_generic_problem(model)}. {_FIX}")
    if sample is None and layers_of is _generic_layers:
        # Registration order is a guess at the forward: train it only once checked.
        raise TypeError(f"splitting {type(model).__name__} as a generic chain "
                        f"({', '.join(layer.name for layer in stack.layers)}) needs a sample "
                        f"input to check it against the model's forward (the CLI uses the data "
                        f"set's; the Python API: wrap(..., data=RunData(dataset))). {_FIX}")
    _check_covers(model, stack)
    if sample is not None:
        output = check_chain(model, stack, sample)
        _return_like(stack, output)
    return stack


def _output_key(output):
    """The key of the tensor the last layer gives in a dict output: a Hugging Face
    ModelOutput's logits (the loss reads them; a cache is left out), or a plain dict's one
    tensor (such as {"logits": ...}); None for a tensor or anything else."""
    if not isinstance(output, Mapping):
        return None
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        return "logits"
    keys = [k for k, v in output.items() if v is not None]
    if len(keys) == 1 and isinstance(output[keys[0]], torch.Tensor):
        return keys[0]
    return None


def _return_like(stack: LayerStack, output) -> None:
    """Make the last layer return what the model's forward returns when that is a dict of
    one tensor (``logits`` in a ModelOutput, or a plain dict): the pipeline's last stage then
    hands the loss the same type every other plan does, so one ``loss_fn(output, target)``
    serves all."""
    key = _output_key(output)
    if key is None:
        return
    kind, last = type(output), stack.layers[-1]

    def forward(root, x, **side):
        return kind(**{key: run_layer(last, root, x, side)})

    stack.layers[-1] = PipeLayer(last.name, last.build, forward, last.side)


# -- Hugging Face GPT-2 --

def _is_gpt2(model: nn.Module) -> bool:
    body = getattr(model, "transformer", None)
    return (isinstance(getattr(model, "lm_head", None), nn.Linear) and body is not None
            and all(hasattr(body, a) for a in ("wte", "wpe", "drop", "h", "ln_f"))
            and isinstance(body.h, nn.ModuleList))


def _gpt2_layers(model: nn.Module) -> list:
    mask = _causal_mask(model.config)

    def embed(root, ids):
        # GPT2Model.forward: token + position embeddings, then dropout.
        wte, wpe, drop = (root.get_submodule(f"transformer.{n}") for n in ("wte", "wpe", "drop"))
        return drop(wte(ids) + wpe(_positions(ids)).to(ids.device))

    def block(i):
        # Stage roots hold the layers in ModuleDicts: look blocks up by path, not index.
        def forward(root, h, attention_mask=None):
            layer = root.get_submodule(f"transformer.h.{i}")
            out = layer(h, attention_mask=mask(h, layer, attention_mask), use_cache=False,
                        position_ids=_positions(h))
            return _first(out)
        return forward

    embed_paths = ("transformer.wte", "transformer.wpe", "transformer.drop")
    return ([_layer(model, "transformer.wte", embed_paths, embed)]
            + [_layer(model, f"transformer.h.{i}", [f"transformer.h.{i}"], block(i),
                      side=("attention_mask",))
               for i in range(len(model.transformer.h))]
            + [_call_layer(model, "transformer.ln_f"), _call_layer(model, "lm_head")])


# -- Hugging Face Llama (and models with its layout: Mistral, Qwen2, ...) --

def _is_llama(model: nn.Module) -> bool:
    body = getattr(model, "model", None)
    return (isinstance(getattr(model, "lm_head", None), nn.Linear) and body is not None
            and all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and isinstance(body.layers, nn.ModuleList))


def _llama_layers(model: nn.Module) -> list:
    mask = _causal_mask(model.config)
    # Parameter-free (its inv_freq buffer is not saved): every stage computes the rotary
    # embeddings from the hidden state's length instead of receiving them.
    rotary = model.model.rotary_emb
    n_used = getattr(model.config, "num_hidden_layers", len(model.model.layers))

    def block(i):
        def forward(root, h, attention_mask=None):
            layer = root.get_submodule(f"model.layers.{i}")
            pos = _positions(h)
            out = layer(h, attention_mask=mask(h, layer, attention_mask), position_ids=pos,
                        position_embeddings=rotary(h, position_ids=pos),
                        past_key_values=None, use_cache=False)
            return _first(out)
        return forward

    return ([_call_layer(model, "model.embed_tokens")]
            + [_layer(model, f"model.layers.{i}", [f"model.layers.{i}"], block(i),
                      side=("attention_mask",))
               for i in range(min(n_used, len(model.model.layers)))]
            + [_call_layer(model, "model.norm"), _call_layer(model, "lm_head")])


def _causal_mask(config):
    """mask(hidden, module, padding mask or None) -> the attention mask HF's
    create_causal_mask gives: for no padding mask, None under sdpa (the kernel's is_causal),
    else an additive float mask; with a (batch, length) padding mask, HF's own."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ("sdpa", "eager"):
        raise TypeError(f"pipeline splitting of {type(config).__name__} models supports "
                        f"attn_implementation 'eager' and 'sdpa', got {impl!r}; fix: build the "
                        f"model with attn_implementation='sdpa'")

    def mask(h, module, padding=None):
        if padding is not None:
            return _hf_causal_mask(config, h, padding)
        if impl == "sdpa":
            return None
        dtype = next(module.parameters()).dtype  # HF: the embeddings' dtype
        n = h.shape[1]
        blocked = torch.ones(n, n, dtype=torch.bool, device=h.device).triu(1)
        zeros = torch.zeros(n, n, dtype=dtype, device=h.device)
        return zeros.masked_fill(blocked, torch.finfo(dtype).min)[None, None]
    return mask


def _hf_causal_mask(config, h: torch.Tensor, padding: torch.Tensor):
    """What the HF model's forward builds from a 2-D padding mask (its own function, so the
    stage computes what the whole model computes; transformers is there: the model is one)."""
    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    pos = _positions(h)
    kwargs = dict(config=config, inputs_embeds=h, attention_mask=padding.view(h.shape[0], -1),
                  position_ids=pos)
    kwargs["cache" if "cache" in params else "past_key_values"] = None
    if "cache_position" in params:  # older transformers
        kwargs["cache_position"] = pos[0]
    return create_causal_mask(**kwargs)


def _positions(h: torch.Tensor) -> torch.Tensor:
    """Position ids 0..len-1 of a (batch, len, ...) tensor, as HF makes them without a cache."""
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _first(out):
    """A block's hidden state: HF blocks return it alone or first in a tuple by version."""
    return out[0] if isinstance(out, (tuple, list)) else out


# -- the generic chain: modules before -> ModuleList of blocks -> modules after --

def _block_lists(model: nn.Module, prefix: str = "") -> list:
    """Paths of the ModuleLists reachable without passing through another ModuleList."""
    found = []
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.ModuleList):
            found.append(path)
        else:
            found.extend(_block_lists(child, path + "."))
    return found


def _generic_problem(model: nn.Module) -> str:
    lists = _block_lists(model)
    return ("it has no nn.ModuleList of blocks" if not lists else
            f"it has {len(lists)} ModuleLists ({', '.join(lists)}) where one is expected")


def _is_generic(model: nn.Module) -> bool:
    return len(_block_lists(model)) == 1


def _generic_layers(model: nn.Module) -> list:
    """One layer per module around the block list (registration order) and per block."""
    blocks = _block_lists(model)[0]
    layers = []

    def walk(module, prefix):
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path == blocks:
                layers.extend(_call_layer(model, f"{path}.{i}") for i in range(len(child)))
            elif blocks.startswith(path + "."):
                walk(child, path + ".")
            else:
                layers.append(_call_layer(model, path))

    walk(model, "")
    return layers


_ARCHITECTURES = ((_is_gpt2, _gpt2_layers), (_is_llama, _llama_layers),
                  (_is_generic, _generic_layers))


# -- layers and checks --

def _layer(model: nn.Module, name: str, paths, forward, side=()) -> PipeLayer:
    """A layer holding the model's modules at ``paths`` (already built: build returns them)."""
    modules = {p: model.get_submodule(p) for p in paths}
    return PipeLayer(name, lambda: dict(modules), forward, tuple(side))


def _call_layer(model: nn.Module, path: str) -> PipeLayer:
    """A layer that calls the module at ``path`` on the tensor it is given."""
    return _layer(model, path, [path], lambda root, x: root.get_submodule(path)(x))


def _layer_paths(stack: LayerStack) -> list:
    return [p for layer in stack.layers for p in layer.build()]


def _check_covers(model: nn.Module, stack: LayerStack) -> None:
    """Every parameter and saved buffer must belong to a layer: a stage trains only those."""
    paths = _layer_paths(stack)
    left = [k for k in model.state_dict()
            if not any(k.startswith(p + ".") for p in paths)]
    if left:
        raise TypeError(f"cannot split {type(model).__name__} into pipeline layers: "
                        f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''} belong to no "
                        f"layer (layers: {', '.join(l.name for l in stack.layers)}); expected "
                        f"{_EXPECTED}. {_FIX}")


def check_chain(model: nn.Module, stack: LayerStack, sample):
    """Raise TypeError unless running the stack's layers in order on ``sample`` (a tensor,
    or a dict of the stack's inputs) gives what ``model(sample)`` (``model(**sample)``)
    gives (the tensor of a dict output: a ModelOutput's ``.logits``), in eval mode.
    Returns what the model returned."""
    check_input(stack, sample)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = model(**sample) if isinstance(sample, Mapping) else model(sample)
            key = _output_key(output)
            want = output if key is None else output[key]
            x, side = split_input(stack.inputs, sample)
            for layer in stack.layers:
                x = run_layer(layer, model, x, side)
    except Exception as exc:  # any failure of the chain says the forward is not one
        raise TypeError(f"{type(model).__name__}: running its layers "
                        f"({', '.join(l.name for l in stack.layers)}) one after the other "
                        f"failed ({type(exc).__name__}: {exc}); expected {_EXPECTED}. "
                        f"{_FIX}") from exc
    finally:
        for m, training in modes.items():
            m.training = training
    if not isinstance(want, torch.Tensor) or want.shape != x.shape \
            or not torch.allclose(x, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())):
        if not isinstance(want, torch.Tensor):
            diff = (f"it returns a {type(output).__name__}"
                    + (f" of {sorted(output)}" if isinstance(output, Mapping) else "")
                    + ", the last layer one tensor (a dict of one tensor is kept)")
        else:
            diff = (float((x - want).abs().max()) if want.shape == x.shape
                    else "a different shape")
        raise TypeError(f"{type(model).__name__}'s forward is not the chain of its layers "
                        f"({', '.join(l.name for l in stack.layers)}): running them one after "
                        f"the other differs from model(x) (by {diff}); expected {_EXPECTED}. "
                        f"{_FIX}")
    return output
