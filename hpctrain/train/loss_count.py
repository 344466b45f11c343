"""What a loss averages over, measured once on the first samples (train.loss_weight = tokens).

The tokens weighting counts a target's elements other than ``ignore_index``. A Hugging Face
style loss (labels = input_ids, shifted inside the loss) averages over one label fewer per
row, and weighting its micro-batches by the labels would be silently off one process. So,
unless the loss declares its count (``loss_fn.count_units``), the model runs once on two
samples and the gradient of the loss with respect to the output says which target positions
the loss reads: the count as given, the shifted count (then used, said once), or neither (a
one-line error asking the loss to declare it). No communication.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hpctrain.data.sampler import collate
from hpctrain.data.structure import call_model, to_device
from hpctrain.errors import UsageError
from hpctrain.models.layers import LayerStack, StackModel
from hpctrain.train.weighting import LossWeighting, shifted_count

__all__ = ["measured_count", "check_loss_count"]


def _labels(y):
    return y["labels"] if isinstance(y, Mapping) and "labels" in y else y


def measured_count(loss_fn, out, y) -> int | None:
    """The target positions ``loss_fn(out, y)`` depends on: those whose output rows get a
    gradient. None when the output's tensor (a ModelOutput's logits, a dict's one tensor)
    does not start with the target's shape."""
    labels = _labels(y)
    key = None
    if isinstance(out, Mapping):
        key = "logits" if "logits" in out else next(iter(out), None)
    t = out if key is None else out[key]
    if not isinstance(t, torch.Tensor) or not isinstance(labels, torch.Tensor) \
            or not t.is_floating_point() or tuple(t.shape[:labels.dim()]) != tuple(labels.shape):
        return None
    leaf = t.detach().clone().requires_grad_(True)
    given = leaf if key is None else type(out)(**{**dict(out), key: leaf})
    with torch.enable_grad():
        grad, = torch.autograd.grad(loss_fn(given, y), leaf, allow_unused=True)
    if grad is None:
        return None
    return int((grad.reshape(*labels.shape, -1) != 0).any(-1).sum())


def check_loss_count(weighting: LossWeighting, model, dataset, loss_fn) -> str | None:
    """Tokens weighting of a loss that declares no count: measure what it averages over on
    the data set's first two samples; declare the shifted count when that is it (return the
    line saying so), raise UsageError when neither count is. Models that cannot run here
    (built on the meta device) are left as they are."""
    if not weighting.tokens or getattr(loss_fn, "count_units", None) is not None:
        return None
    if isinstance(model, LayerStack):
        with torch.device("meta"):
            if any(p.is_meta for p in model.build(range(len(model))).parameters()):
                return None  # a built-in described layer by layer: its loss counts as given
        model = StackModel(model)  # the layers of an already built model
    if any(p.is_meta for p in model.parameters()) or not len(dataset):
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    x, y = (to_device(b, device) for b in collate(dataset, range(min(2, len(dataset)))))
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = call_model(model, x)
    finally:
        for m, training in modes.items():
            m.training = training
    counted = measured_count(loss_fn, out, y)
    given, shifted = weighting.count(y), shifted_count(weighting.ignore_index)
    if counted is None or counted == given:
        return None
    if counted == shifted(y):
        weighting.declare(loss_fn, shifted)
        return (f"hpctrain: note: train.loss_weight = tokens: the loss shifts its labels "
                f"(Hugging Face style: it reads {counted} of the first samples' {given} "
                f"labels), so micro-batches count labels[..., 1:]; set loss_fn.count_units "
                f"to say so yourself")
    raise UsageError(f"train.loss_weight = 'tokens': the loss reads {counted} target "
                     f"positions of the first two samples, but the weighting counts {given} "
                     f"(targets other than {weighting.ignore_index}); say what it averages "
                     f"over with loss_fn.count_units = fn(target) -> int, or use "
                     f"loss_weight = 'samples'")
