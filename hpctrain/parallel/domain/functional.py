"""What a domain model's forward calls itself: followed op by op, made exact or refused.

convert.py swaps layers; the functions a forward calls (``x.mean((2, 3))``,
``F.max_pool2d(x, 3, 1, 1)``, ``F.interpolate``) are invisible to it and would run on a
tile as if it were the grid. ``DomainFunctions`` is a torch function mode that follows
which tensors are SPLIT (their last nd dims are this rank's tile of the grid, or, after
``flatten``, their last dim is the tile's points) and, for every op that reads one:
- passes it when it works point by point or along batch/channel dims only;
- makes it exact when it reduces over the whole grid (sum/mean/amax/amin, adaptive pooling
  to 1: tile partials reduced over ``dom``, an autograd Function with the exact adjoint) or
  is a window op (conv, pooling, nearest and (bi)linear interpolation: the layers' halo
  exchange);
- refuses anything else (ValueError) with the op and the model's line that calls it.
``check`` runs it on one process over a whole sample (the CLI before MPI, ``prepare``
before any collective); the executor runs it on the tiles in training.
"""

from __future__ import annotations

import itertools
import math
import os
import traceback

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from hpctrain.parallel.domain.grid_reduce import GridReduce
from hpctrain.parallel.domain.groupnorm import DomainGroupNorm
from hpctrain.parallel.domain.layers import (DomainConv, DomainConvFn, DomainLinearUp, DomainPool,
                                             DomainUpsample, DomainWindowOp, domain_upsample)
from hpctrain.parallel.domain.op_rules import (ALL_DIMS, ALONG, CONV_ARGS, EXACT, INTERP_ARGS,
                                               LINEAR_MODES, META, POOL_ARGS, POOL_DEFAULTS,
                                               REQUIRED, SECOND_DIM, SHAPE, arg, bind, dims_of,
                                               hashable, is_pointwise, op_name, tensors_in)
from hpctrain.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["DomainFunctions", "check", "spatial_ndim"]

TILE = "tile"  # the kind of a split tensor: its last nd dims are the tile (a flat one: a tuple)
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODES = itertools.count()
_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def spatial_ndim(model: nn.Module) -> int:
    """How many trailing dims are the grid: those of the model's first conv."""
    for m in model.modules():
        if isinstance(m, nn.modules.conv._ConvNd):
            return len(m.kernel_size)
    raise ValueError("domain parallel found no Conv1d/2d/3d in the model, so it cannot tell "
                     "how many spatial dims to split; use a convolutional model")


class _CheckGrid:
    """Stands in for the DomainGrid when a layer is only built to validate its arguments."""

    def __init__(self, nd):
        self.ndim, self.shape = nd, (1,) * nd


def _where() -> str:
    """file:line (and code) of the innermost caller outside torch and this package."""
    for fr in reversed(traceback.extract_stack()):
        path = os.path.abspath(fr.filename)
        if path.startswith(_TORCH) or path.startswith(_HERE) or fr.filename.startswith("<"):
            continue
        rel = os.path.relpath(path)
        return f"{path if rel.startswith('..') else rel}:{fr.lineno} ({(fr.line or '').strip()})"
    return "an unknown line"


class DomainFunctions(TorchFunctionMode):
    """The torch function mode of a domain forward (see the module doc).

    ``grid`` None: the check, on one process over whole tensors (ops run as they are and
    are only classified); otherwise the tiles of ``grid``. ``watch`` marks the layers that
    convert.py makes domain parallel: ops inside them are theirs.
    """

    def __init__(self, nd: int, grid=None, overlap: bool = False):
        super().__init__()
        self.nd, self.grid, self.overlap = nd, grid, overlap
        # A tensor's kind is an attribute it carries (cheaper than a weak dictionary on every
        # op, and kept when checkpointing's recompute gets the saved tensor back); one name
        # per mode, so the one-process check's marks mean nothing to training.
        self._mark = f"_hpctrain_domain_split_{next(_MODES)}"
        self._on, self.depth, self._entered = False, 0, 0
        self._ops: dict = {}  # window ops by arguments: their halo plans are cached inside

    # ---- entry points -----------------------------------------------------------------
    def split(self, t: torch.Tensor) -> torch.Tensor:
        """Mark t as split (its last nd dims are a tile of the grid)."""
        setattr(t, self._mark, TILE)
        return t

    def kind(self, t):
        return getattr(t, self._mark, None) if isinstance(t, torch.Tensor) else None

    def __enter__(self):
        self._entered += 1
        self._on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._entered -= 1
        if not self._entered:
            self._on, self.depth = False, 0
        return super().__exit__(*exc)

    def watch(self, model: nn.Module, check: bool) -> list:
        """Route the layers convert.py handles (the originals when ``check``, else the
        converted ones) through ``_layer``; returns handles whose ``remove()`` undoes it."""
        handles = []
        for m in model.modules():
            if check:
                ours = ((isinstance(m, nn.modules.conv._ConvNd) and not m.transposed)
                        or isinstance(m, (*_POOLS, nn.Upsample, nn.GroupNorm, _BatchNorm)))
            else:
                ours = isinstance(m, (DomainWindowOp, DomainGroupNorm, SyncBatchNorm))
            if ours:
                handles.append(_Routed(m, self))
        return handles

    # ---- layers convert.py made domain parallel ------------------------------------------
    def _layer(self, module, forward, args, kwargs):
        """A layer that splits itself: its own ops run without the mode (no per-op cost);
        its output is split when its input is."""
        if not self._on or self.depth:  # outside the forward, or inside one of our layers
            return forward(*args, **kwargs)
        kinds = [getattr(t, self._mark, None) for t in tensors_in(args, kwargs)]
        split = any(k is not None for k in kinds)
        window = isinstance(module, (nn.modules.conv._ConvNd, *_POOLS, nn.Upsample,
                                     DomainWindowOp))
        if split and any(k is not None and k != TILE for k in kinds):
            self._refuse(type(module).__name__, "is applied to a flattened grid")
        if not split and not window:
            self._refuse(type(module).__name__, "normalizes a tensor that is not split over "
                         "the grid (it was reduced over the grid before) as if it were a tile",
                         "apply the norm to the field itself, or drop it after the reduction")
        if split and self.grid is None and window:
            self._validate_layer(module)
        plain = not split and isinstance(module, DomainWindowOp)
        self.depth += 1
        try:
            if plain:
                module.plain = True  # a tensor every rank holds whole: the op as is, no halo
            stack = torch.overrides._get_current_function_mode_stack()
            if stack and stack[-1] is self:
                with torch.overrides._pop_mode_temporarily():
                    out = forward(*args, **kwargs)
            else:
                out = forward(*args, **kwargs)
        finally:
            self.depth -= 1
            if plain:
                module.plain = False
        return self._tag(out, TILE) if split else out

    def _validate_layer(self, module):
        stub = _CheckGrid(self.nd)
        try:
            if isinstance(module, nn.modules.conv._ConvNd):
                DomainConv(module, stub)
            elif isinstance(module, _POOLS):
                DomainPool(module, stub)
            elif isinstance(module, nn.Upsample):
                domain_upsample(module, stub)
        except ValueError as exc:
            self._refuse(type(module).__name__, str(exc))

    # ---- every torch function ----------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        mark = self._mark
        for t in tensors_in(args, kwargs):
            if hasattr(t, mark):
                return self._on_split(func, args, kwargs)
        return func(*args, **kwargs)

    def _refuse(self, what: str, why: str, fix: str = ""):
        fix = fix or ("compute it on the field point by point, reduce over the whole grid "
                      "(sum/mean/amax/amin over all spatial dims), or use conv/pooling/nearest "
                      "upsampling, which get their halo; or train this model without the "
                      "domain split")
        raise ValueError(f"domain parallel cannot split {what} at {_where()}: it {why}; fix: "
                         f"{fix}")

    def _on_split(self, func, args, kwargs):
        name = getattr(func, "__name__", "")
        if name in META or name == "__get__" and func.__self__.__name__ in (
                "shape", "ndim", "dtype", "device", "requires_grad", "is_cuda", "layout",
                "is_leaf", "grad_fn", "names"):
            return func(*args, **kwargs)
        if name == "__get__":
            if func.__self__.__name__ in ("data", "grad", "real", "imag"):
                return self._tag(func(*args, **kwargs), self.kind(args[0]))
            self._refuse(op_name(func), "reorders or mixes the dims of a tile")
        if name in ("max", "min", "maximum", "minimum") and (
                len(args) > 1 and isinstance(args[1], torch.Tensor) or "other" in kwargs):
            return self._pointwise(func, args, kwargs)
        if name in ("conv1d", "conv2d", "conv3d") or name.startswith(("max_pool", "avg_pool")) \
                or name == "interpolate":
            return self._window(func, name, args, kwargs)
        if name.startswith(("adaptive_avg_pool", "adaptive_max_pool")):
            return self._adaptive(func, name, args, kwargs)
        if name in EXACT or name in ("max", "min"):
            return self._reduce(func, name, args, kwargs)
        if name in ALONG:
            return self._along(func, name, args, kwargs)
        if name in SHAPE:
            return self._reshape(func, args, kwargs)
        if name in ("permute", "movedim", "moveaxis"):
            return self._permute(func, name, args, kwargs)
        if name in ("cat", "concat", "concatenate", "stack"):
            return self._cat(func, name, args, kwargs)
        if name == "unsqueeze":
            return self._unsqueeze(func, args, kwargs)
        if name == "__getitem__":
            return self._getitem(func, args, kwargs)
        if name == "__setitem__":
            return self._setitem(func, args, kwargs)
        if name == "flip":
            return self._flip(func, args, kwargs)
        if is_pointwise(name):
            return self._pointwise(func, args, kwargs)
        self._refuse(op_name(func), "is not known to work point by point, and may read across "
                     "the split grid")

    # ---- helpers -----------------------------------------------------------------------
    def _span(self, kind) -> int:
        """How many trailing dims are split: nd for a tile, 1 for a flattened one."""
        return self.nd if kind == TILE else 1

    def _tag(self, out, kind):
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                setattr(t, self._mark, kind)
        return out

    def _split_dims(self, x) -> set:
        n = self._span(self.kind(x))
        return set(range(x.dim() - n, x.dim()))

    def _pointwise(self, func, args, kwargs):
        ts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        kinds = {self.kind(t) for t in ts} - {None}
        if len(kinds) > 1:
            self._refuse(op_name(func), "combines a tile with a flattened tile")
        kind = kinds.pop()
        n = self._span(kind)
        tile = next(t for t in ts if self.kind(t) is not None).shape[-n:]
        for t in ts:
            if self.kind(t) is None and any(s != 1 for s in t.shape[-n:]):
                self._refuse(op_name(func), f"combines a tile with a tensor of shape "
                             f"{tuple(t.shape)} that is not split but spans the grid's "
                             "dims (it would meet each tile as if it were the whole grid)",
                             "make that tensor size 1 along the spatial dims (broadcast), or "
                             "derive it from the split input")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape[-n:]) != tuple(tile):
                self._refuse(op_name(func), "changes the extent of the split dims")
        return self._tag(out, kind)

    def _along(self, func, name, args, kwargs):
        x = args[0]
        pos, kw, default = ALONG[name]
        value = arg(args, kwargs, pos, kw, default)
        if value is REQUIRED or value is None and default is REQUIRED:
            self._refuse(op_name(func), "has no dim given (it would act on the split dims)",
                         "pass dim= a batch or channel dim")
        every = value is ALL_DIMS or value is None
        dims = list(range(x.dim())) if every else dims_of(value, x.dim())
        if name in SECOND_DIM:
            dims += dims_of(arg(args, kwargs, *SECOND_DIM[name], 0), x.dim())
        if set(dims) & self._split_dims(x):
            self._refuse(op_name(func), f"acts along dim(s) {dims}, which include the split "
                         f"spatial dims of a {x.dim()}-d tile")
        return self._tag(func(*args, **kwargs), self.kind(x))

    def _flip(self, func, args, kwargs):
        x = args[0]
        dims = kwargs.get("dims", args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else ()))
        if set(dims_of(dims, x.dim())) & self._split_dims(x):
            self._refuse(op_name(func), "reverses a split dim")
        return self._tag(func(*args, **kwargs), self.kind(x))

    def _unsqueeze(self, func, args, kwargs):
        x = args[0]
        d = int(arg(args, kwargs, 1, "dim", 0)) % (x.dim() + 1)
        if d > x.dim() - self._span(self.kind(x)):
            self._refuse(op_name(func), "inserts a dim among the split spatial dims")
        return self._tag(func(*args, **kwargs), self.kind(x))

    def _reduce(self, func, name, args, kwargs):
        x = args[0]
        if name in ("max", "min"):
            if len(args) > 1 or "dim" in kwargs:  # with dim: values AND tile-local indices
                return self._along(func, name, args, kwargs)
            op, dims, keep = "a" + name, list(range(x.dim())), False
        else:
            op = EXACT[name]
            value = arg(args, kwargs, 1, "dim", None)
            dims = list(range(x.dim())) if value is None or value == [] else dims_of(value, x.dim())
            keep = bool(arg(args, kwargs, 2, "keepdim", False))
        split = self._split_dims(x)
        if not split & set(dims):
            return self._tag(func(*args, **kwargs), self.kind(x))
        if not split <= set(dims):
            self._refuse(op_name(func), f"reduces over dims {dims}, some but not all of the "
                         f"split spatial dims {sorted(split)}", "reduce over all spatial dims "
                         "at once (e.g. x.mean((2, 3))) or over none")
        return self._grid_reduce(func, x, dims, keep, op, kwargs.get("dtype"), args, kwargs)

    def _grid_reduce(self, func, x, dims, keep, op, dtype, args, kwargs):
        if self.grid is None:
            return func(*args, **kwargs)  # the whole grid: the result is not split
        if dtype is not None:
            x = x.to(dtype)
        kind = self.kind(args[0])
        local = tuple(x.shape[-self.nd:]) if kind == TILE else kind
        count = math.prod(self.grid.global_shape(local))  # collective (cached per forward)
        split = self._split_dims(args[0])
        count *= math.prod(x.shape[d] for d in dims if d not in split)
        return GridReduce.apply(x, tuple(dims), keep, op, self.grid.comm, count)

    def _adaptive(self, func, name, args, kwargs):
        x = args[0]
        size = arg(args, kwargs, 1, "output_size", None)
        sizes = size if isinstance(size, (tuple, list)) else (size,) * self.nd
        if self.kind(x) != TILE or any(s != 1 for s in sizes) or arg(
                args, kwargs, 2, "return_indices", False):
            self._refuse(op_name(func), f"pools to {size} with windows that depend on the "
                         "whole grid", "pool to 1 (a global mean/max, made exact) or use "
                         "fixed-window pooling")
        dims = list(range(x.dim() - self.nd, x.dim()))
        op = "mean" if "avg" in name else "amax"
        return self._grid_reduce(func, x, dims, True, op, None, args, kwargs)

    def _reshape(self, func, args, kwargs):
        x, kind = args[0], self.kind(args[0])
        out = func(*args, **kwargs)
        n = self._span(kind)
        xs, os_ = tuple(x.shape), tuple(out.shape)
        if len(os_) >= n and os_[len(os_) - n:] == xs[len(xs) - n:] and \
                math.prod(os_[:len(os_) - n]) == math.prod(xs[:len(xs) - n]):
            return self._tag(out, kind)  # only batch/channel dims regrouped
        if kind == TILE and self.nd > 1 and os_[:-1] == xs[:-self.nd] and \
                os_[-1] == math.prod(xs[-self.nd:]):
            return self._tag(out, xs[-self.nd:])  # the tile's points in one dim
        self._refuse(op_name(func), f"reshapes a split tensor {xs} to {os_}, mixing the split "
                     "spatial dims with others", "keep the spatial dims last and whole, or "
                     "flatten exactly them and reduce the result (x.flatten(2).mean(-1))")

    def _permute(self, func, name, args, kwargs):
        x = args[0]
        split = self._split_dims(x)
        if name == "permute":
            perm = args[1:] if len(args) > 2 else arg(args, kwargs, 1, "dims", ())
            perm = [int(p) % x.dim() for p in
                    (perm if isinstance(perm, (list, tuple, torch.Size)) else [perm])]
            ok = all(perm[d] == d for d in split)
        else:
            src = dims_of(arg(args, kwargs, 1, "source", ()), x.dim())
            dst = dims_of(arg(args, kwargs, 2, "destination", ()), x.dim())
            ok = not (set(src) | set(dst)) & split
        if not ok:
            self._refuse(op_name(func), "moves the split spatial dims from the end")
        return self._tag(func(*args, **kwargs), self.kind(x))

    def _cat(self, func, name, args, kwargs):
        ts = list(arg(args, kwargs, 0, "tensors", ()))
        kinds = {self.kind(t) for t in ts}
        if len(kinds) != 1:
            self._refuse(op_name(func), "joins split tensors with tensors that are not split "
                         "(or tiles with flattened tiles)")
        kind = kinds.pop()
        x = ts[0]
        nd_out = x.dim() + (name == "stack")
        d = int(arg(args, kwargs, 1, "dim", 0)) % nd_out
        if d >= nd_out - self._span(kind) + (name == "stack"):
            self._refuse(op_name(func), f"joins along dim {d}, a split spatial dim",
                         "join along the batch or channel dim")
        return self._tag(func(*args, **kwargs), kind)

    def _index_ok(self, x, idx) -> bool:
        n = self._span(self.kind(x))
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, (torch.Tensor, list, bool)) for i in items):
            return len(items) == 1 and isinstance(idx, torch.Tensor) and idx.dim() <= 1 \
                and idx.dtype != torch.bool  # rows of dim 0
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        full, dim = [], 0
        for i in items:
            if i is Ellipsis:
                full += [slice(None)] * (x.dim() - used)
                continue
            full.append(i)
        first_split = x.dim() - n
        for i in full:
            if i is None:
                if dim > first_split:
                    return False
                continue
            if dim >= first_split and i != slice(None):
                return False
            dim += 1
        return True

    def _getitem(self, func, args, kwargs):
        if not self._index_ok(args[0], args[1]):
            self._refuse(op_name(func), f"indexes a split dim ({args[1]!r}): a tile's index is "
                         "not the grid's", "index batch/channel dims only")
        return self._tag(func(*args, **kwargs), self.kind(args[0]))

    def _setitem(self, func, args, kwargs):
        x, idx, value = args[0], args[1], args[2]
        if self.kind(x) is None or not self._index_ok(x, idx):
            self._refuse(op_name(func), "writes into a split dim, or writes a tile into a "
                         "tensor that is not split", "index batch/channel dims only")
        if isinstance(value, torch.Tensor) and self.kind(value) is None and any(
                s != 1 for s in value.shape[-self._span(self.kind(x)):]):
            self._refuse(op_name(func), "writes a tensor that spans the grid into a tile")
        return func(*args, **kwargs)

    def _interpolation(self, func, nd, args, kwargs):
        """(arguments, cache key, layer factory) of F.interpolate: nearest or (bi/tri)linear
        with align_corners=False, by integer factors."""
        a = bind(INTERP_ARGS, {"size": None, "scale_factor": None, "mode": "nearest",
                                 "align_corners": None, "antialias": False}, args, kwargs)
        sf = a["scale_factor"]
        factors = tuple(sf) if isinstance(sf, (list, tuple)) else (sf,) * nd
        mode = a["mode"]
        linear = mode == LINEAR_MODES.get(nd) and not a["align_corners"] and not a["antialias"]
        if a["size"] is not None or sf is None or not (mode == "nearest" or linear) or any(
                float(f) != int(f) or f < 1 for f in factors):
            self._refuse(f"{op_name(func)}(mode={mode!r}, size={a['size']!r}, scale_factor="
                         f"{sf!r}, align_corners={a['align_corners']!r})",
                         "has no halo rule here", "give an integer scale_factor (not size=) "
                         "with mode='nearest', or a linear mode with align_corners=False")
        factors = tuple(int(f) for f in factors)
        if linear:
            return a, ("interpolate", mode, factors), \
                lambda g: DomainLinearUp(g, factors, self.overlap)
        return a, ("interpolate", nd, factors), lambda g: DomainUpsample(
            nn.Upsample(scale_factor=factors), g, self.overlap)

    def _window(self, func, name, args, kwargs):
        x = args[0]
        if self.kind(x) != TILE:
            self._refuse(op_name(func), "is applied to a flattened grid")
        if any(self.kind(t) is not None for t in tree_leaves((args[1:], kwargs))):
            self._refuse(op_name(func), "takes a split tensor as its weight")
        nd = x.dim() - 2
        if name == "interpolate":
            a, key, make = self._interpolation(func, nd, args, kwargs)
        elif name.startswith("conv"):
            a = bind(CONV_ARGS, {"bias": None, "stride": 1, "padding": 0, "dilation": 1,
                                   "groups": 1}, args, kwargs)
            kernel = tuple(a["weight"].shape[2:])
            key = (name, kernel) + tuple(hashable(a[k]) for k in CONV_ARGS[2:])
            make = lambda g: DomainConvFn(g, len(kernel), kernel, a["stride"], a["padding"],
                                          a["dilation"], a["groups"], self.overlap)
        else:
            kind = name[:3]
            a = bind(POOL_ARGS[kind], POOL_DEFAULTS, args, kwargs)
            if a.get("return_indices"):
                self._refuse(op_name(func) + "(return_indices=True)", "returns tile-local "
                             "indices", "pool without indices")
            pnd = int(name[-2])
            cls = getattr(nn, f"{kind.capitalize()}Pool{pnd}d")
            opts = {k: a[k] for k in POOL_ARGS[kind] if k != "return_indices"
                    and not (pnd == 1 and k == "divisor_override")}
            key = (name,) + tuple(hashable(v) for v in opts.values())
            make = lambda g: DomainPool(cls(**opts), g, self.overlap)
        try:
            op = make(_CheckGrid(self.nd)) if self.grid is None else self._ops.get(key)
            if op is None:
                op = self._ops[key] = make(self.grid)
        except ValueError as exc:
            self._refuse(op_name(func), " ".join(str(exc).split()))
        if self.grid is None:
            return self.split(func(*args, **kwargs))
        out = op(x, a["weight"], a["bias"]) if name.startswith("conv") else op(x)
        return self.split(out)


class _Routed:
    """A layer's forward routed through ``DomainFunctions._layer`` (an instance attribute,
    so parameter names do not change); ``remove()`` restores it."""

    def __init__(self, module: nn.Module, mode: DomainFunctions):
        self.module, self._own = module, "forward" in module.__dict__
        forward = module.forward

        def routed(*args, **kwargs):
            return mode._layer(module, forward, args, kwargs)
        self._saved = module.__dict__.get("forward")
        module.forward = routed

    def remove(self) -> None:
        if self._own:
            self.module.forward = self._saved
        else:
            del self.module.forward


def check(model: nn.Module, sample: torch.Tensor) -> None:
    """Run ``model`` once on a whole ``sample`` under the mode, on this process only (no
    communication), in eval mode without gradients; raise ValueError naming the first op a
    tile cannot compute (and the model's line), or if the output is not split like a field."""
    mode = DomainFunctions(spatial_ndim(model))
    handles = mode.watch(model, check=True)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]), mode:
            out = model(mode.split(sample))
        kind = mode.kind(out)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    if kind != TILE:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"domain parallel: {type(model).__name__}'s output ({shape}) is not a "
                         f"field split like its input (each rank's loss compares its tile of "
                         f"the output with its tile of the target); return a field of the "
                         f"grid's shape, or use a data-parallel plan")
