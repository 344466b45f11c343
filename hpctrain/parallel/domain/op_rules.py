"""Which torch functions a domain forward may run on a tile, and how they are named.

``DomainFunctions`` (functional.py) sorts every torch function that reads a split tensor by
these tables: point-wise ops pass, ops along one dim pass while that dim is not a split one,
whole-grid reductions are made exact, shape ops keep or refuse the split. The readers below
take a function's arguments by position or keyword, as torch binds them; ``op_name`` is the
name an error gives the op (``torch.nn.functional.max_pool2d``, ``Tensor.mean``).
"""

from __future__ import annotations

import torch

__all__ = ["ALL_DIMS", "ALONG", "CONV_ARGS", "EXACT", "INTERP_ARGS", "LINEAR_MODES", "META",
           "POOL_ARGS", "POOL_DEFAULTS", "REQUIRED", "SECOND_DIM", "SHAPE", "arg", "bind",
           "dims_of", "hashable", "is_pointwise", "op_name", "tensors_in"]


def op_name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    mod = getattr(func, "__module__", None) or ""
    if name == "__get__":
        return f"Tensor.{func.__self__.__name__}"
    for sub in ("fft", "linalg", "special"):  # torch.fft.fft2 is torch._C._fft.fft_fft2
        if mod == f"torch._C._{sub}":
            return f"torch.{sub}.{name.removeprefix(sub + '_')}"
    if mod.startswith("torch.nn.functional") or mod.startswith("torch._C._nn"):
        return f"torch.nn.functional.{name}"
    if mod == "torch" or getattr(func, "__self__", None) is torch._C._VariableFunctions:
        return f"torch.{name}"
    return f"Tensor.{name}" if hasattr(torch.Tensor, name) else name


_DUNDER = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and": "bitwise_and",
           "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not", "abs": "abs"}
# Point-wise ops aten does not tag as such (composites, conversions, masks drawn per element).
_EXTRA_POINTWISE = {
    "to", "type", "float", "double", "half", "bfloat16", "cpu", "cuda", "contiguous", "clone",
    "detach", "detach_", "type_as", "dropout", "dropout_", "alpha_dropout", "relu6",
    "hardswish", "hardsigmoid", "softsign", "tanhshrink", "threshold", "logsigmoid", "selu",
    "celu", "masked_fill", "masked_fill_", "where", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "nan_to_num", "expand", "expand_as", "broadcast_to",
    "repeat", "maximum", "minimum", "fmax", "fmin"}
META = {"size", "dim", "__len__", "is_contiguous", "is_floating_point", "is_complex",
         "element_size", "stride", "data_ptr", "__repr__", "__format__", "__str__",
         "get_device", "storage_offset", "requires_grad_", "retain_grad", "register_hook",
         "__set__"}
_pointwise_cache: dict = {}


def is_pointwise(name: str) -> bool:
    if name in _pointwise_cache:
        return _pointwise_cache[name]
    base = name.strip("_")
    cands = [base, _DUNDER.get(base, ""), base[1:] if base[:1] in "ri" else "",
             _DUNDER.get(base[1:], "") if base[:1] in "ri" else ""]
    ok = name in _EXTRA_POINTWISE
    for c in filter(None, cands):
        packet = getattr(torch.ops.aten, c, None)
        if isinstance(packet, torch._ops.OpOverloadPacket) and any(
                torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()):
            ok = True
            break
    _pointwise_cache[name] = ok
    return ok


# Ops along one dim (or a list of them): fine while that dim is not a split one.
# name -> (position, keyword, default); ALL_DIMS: missing means every dim; REQUIRED: must
# be given.
ALL_DIMS, REQUIRED = object(), object()
ALONG = {
    "softmax": (1, "dim", REQUIRED), "log_softmax": (1, "dim", REQUIRED),
    "cumsum": (1, "dim", REQUIRED), "cumprod": (1, "dim", REQUIRED),
    "logcumsumexp": (1, "dim", REQUIRED), "cummax": (1, "dim", REQUIRED),
    "cummin": (1, "dim", REQUIRED), "split": (2, "dim", 0), "chunk": (2, "dim", 0),
    "tensor_split": (2, "dim", 0), "narrow": (1, "dim", REQUIRED), "select": (1, "dim", REQUIRED),
    "index_select": (1, "dim", REQUIRED), "unbind": (1, "dim", 0), "roll": (2, "dims", REQUIRED),
    "sort": (1, "dim", -1), "argsort": (1, "dim", -1), "topk": (2, "dim", -1),
    "kthvalue": (2, "dim", -1), "squeeze": (1, "dim", REQUIRED), "normalize": (2, "dim", 1),
    "transpose": (1, "dim0", REQUIRED), "swapaxes": (1, "axis0", REQUIRED),
    "swapdims": (1, "dim0", REQUIRED),
    # reductions that are not made exact: fine over batch/channel dims only
    "std": (1, "dim", ALL_DIMS), "var": (1, "dim", ALL_DIMS), "prod": (1, "dim", ALL_DIMS),
    "norm": (2, "dim", ALL_DIMS), "logsumexp": (1, "dim", REQUIRED),
    "argmax": (1, "dim", ALL_DIMS), "argmin": (1, "dim", ALL_DIMS), "all": (1, "dim", ALL_DIMS),
    "any": (1, "dim", ALL_DIMS), "count_nonzero": (1, "dim", ALL_DIMS),
    "median": (1, "dim", ALL_DIMS), "nansum": (1, "dim", ALL_DIMS),
    "nanmean": (1, "dim", ALL_DIMS), "std_mean": (1, "dim", ALL_DIMS),
    "var_mean": (1, "dim", ALL_DIMS), "max": (1, "dim", ALL_DIMS), "min": (1, "dim", ALL_DIMS),
}
SECOND_DIM = {"transpose": (2, "dim1"), "swapaxes": (2, "axis1"), "swapdims": (2, "dim1")}
EXACT = {"sum": "sum", "mean": "mean", "amax": "amax", "amin": "amin"}
SHAPE = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
POOL_ARGS = {  # F signatures after the input
    "max": ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
    "avg": ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad",
            "divisor_override")}
POOL_DEFAULTS = {"stride": None, "padding": 0, "dilation": 1, "ceil_mode": False,
                  "return_indices": False, "count_include_pad": True, "divisor_override": None}
CONV_ARGS = ("weight", "bias", "stride", "padding", "dilation", "groups")
INTERP_ARGS = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor",
                "antialias")


def bind(names, defaults, args, kwargs) -> dict:
    out = dict(defaults)
    out.update(zip(names, args[1:]))
    out.update(kwargs)
    return out


def arg(args, kwargs, pos, kw, default):
    if kw in kwargs:
        return kwargs[kw]
    return args[pos] if len(args) > pos else default


def dims_of(value, ndim) -> list:
    vals = list(value) if isinstance(value, (tuple, list, torch.Size)) else [value]
    return sorted({int(v) % ndim for v in vals}) if ndim else []


LINEAR_MODES = {1: "linear", 2: "bilinear", 3: "trilinear"}


def hashable(v):
    return tuple(v) if isinstance(v, list) else v


def tensors_in(args, kwargs):
    """The tensors among a torch function's arguments (and in its list arguments): cheaper
    than a pytree walk, on every op of the forward."""
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        yield b
