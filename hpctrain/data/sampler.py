"""Deterministic global-batch sampler whose per-rank split never changes the global batch."""

import operator
from collections.abc import Mapping

import torch
from torch.utils.data import Dataset, TensorDataset

from .structure import check_batch, take_rows, zero_rows
from .synthetic import TensorPairDataset

__all__ = ["GlobalBatchSampler", "CollatedDataset", "collate", "split_global_batch", "as_pair"]

_MASK64 = (1 << 64) - 1


def _as_int(name, value):
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


class GlobalBatchSampler:
    """Yields this rank's indices of each micro-batch of each global step.

    The global batch of a step depends only on (dataset_len, global_batch_size, seed, step);
    it is cut into `grad_accum` micro-batches first and each micro-batch is then cut across
    ranks, so the union over ranks of micro-batch m is the same for any world size.
    """

    def __init__(self, dataset_len, global_batch_size, seed, rank, world_size, grad_accum=1):
        dataset_len = _as_int("dataset_len", dataset_len)
        global_batch_size = _as_int("global_batch_size", global_batch_size)
        rank, world_size = _as_int("rank", rank), _as_int("world_size", world_size)
        grad_accum = _as_int("grad_accum", grad_accum)
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}; "
                             "fix: pass a positive global batch size")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}; "
                             "fix: use grad_accum=1 for no gradient accumulation")
        if grad_accum > global_batch_size:
            raise ValueError(f"grad_accum ({grad_accum}) is larger than global_batch_size "
                             f"({global_batch_size}), so some micro-batches would be empty; "
                             "fix: lower grad_accum or raise global_batch_size")
        if dataset_len < global_batch_size:
            raise ValueError(f"the data set has {dataset_len} samples, fewer than one global "
                             f"batch of {global_batch_size}; fix: lower global_batch_size to at "
                             f"most {dataset_len} or use a larger data set")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.grad_accum = grad_accum
        self.steps_per_epoch = dataset_len // global_batch_size  # last partial batch dropped
        self.step = 0  # next step that iteration will return
        self._perm_epoch = None
        self._perm = None

    def epoch_of(self, step):
        """The epoch that global step `step` falls in."""
        return step // self.steps_per_epoch

    def _permutation(self, epoch):
        if epoch != self._perm_epoch:
            g = torch.Generator()
            g.manual_seed((self.seed * 1000003 + epoch) & _MASK64)
            self._perm = torch.randperm(self.dataset_len, generator=g)
            self._perm_epoch = epoch
        return self._perm

    def global_batch(self, step):
        """All indices (every rank, every micro-batch) of global step `step`, in order."""
        step = _as_int("step", step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, pos = divmod(step, self.steps_per_epoch)
        start = pos * self.global_batch_size
        return self._permutation(epoch)[start:start + self.global_batch_size].clone()

    def micro_batches(self, step):
        """This rank's indices for each of the `grad_accum` micro-batches of `step`."""
        return split_global_batch(self.global_batch(step), self.grad_accum, self.rank,
                                  self.world_size)

    def __iter__(self):
        return self

    def __next__(self):
        """Micro-batches of the current step; advances the step counter."""
        out = self.micro_batches(self.step)
        self.step += 1
        return out

    def state_dict(self):
        """The position of the step counter."""
        return {"step": self.step}

    def load_state_dict(self, state):
        """Restore the step counter saved by state_dict()."""
        if "step" not in state:
            raise ValueError(f"sampler state has no 'step' entry (keys: {sorted(state)})")
        step = _as_int("step", state["step"])
        if step < 0:
            raise ValueError(f"sampler state step must be >= 0, got {step}")
        self.step = step


def split_global_batch(batch, grad_accum, rank, world_size):
    """Rank `rank`'s part of each of the `grad_accum` micro-batches of `batch` (a 1-D tensor
    of sample indices or row numbers): micro-batches first, then ranks, so the union over
    ranks of micro-batch m is the same for any world size."""
    micros = torch.tensor_split(batch, grad_accum)
    return [torch.tensor_split(m, world_size)[rank].clone() for m in micros]


def collate(dataset, indices):
    """Stack dataset items at `indices` into (inputs, targets); zero-length when empty."""
    if (isinstance(dataset, TensorPairDataset) and isinstance(indices, range)
            and indices == range(len(dataset))):
        # A batch already read (data/loader.py): as is, so pinned memory stays pinned.
        return dataset.inputs, dataset.targets
    if isinstance(indices, torch.Tensor):
        indices = indices.to(torch.int64).reshape(-1)
    else:
        indices = torch.as_tensor(list(indices), dtype=torch.int64)
    # Fast path: the data already sits in two tensors.
    if isinstance(dataset, TensorPairDataset):
        return take_rows(dataset.inputs, indices), take_rows(dataset.targets, indices)
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0][indices], dataset.tensors[1][indices]
    if isinstance(dataset, CollatedDataset) and indices.numel():
        return dataset.collate_indices(indices.tolist())
    if indices.numel() == 0:
        # Shapes and dtypes come from the first item so empty ranks still match the others.
        return tuple(zero_rows(_item(v)) for v in dataset[0])
    items = [dataset[i] for i in indices.tolist()]
    return (torch.stack([torch.as_tensor(x) for x, _ in items]),
            torch.stack([torch.as_tensor(y) for _, y in items]))


def _item(v):
    """A data set item's input or target as tensors: a structure of tensors (a dict, or a
    tuple of tensors) as it is, anything else (numbers, lists, arrays) through as_tensor."""
    if isinstance(v, (torch.Tensor, Mapping)) or (
            isinstance(v, (tuple, list)) and v and all(isinstance(t, torch.Tensor) for t in v)):
        return v
    return torch.as_tensor(v)


class CollatedDataset(Dataset):
    """A map-style dataset with its DataLoader's ``collate_fn`` (hpctrain.Trainer.fit): a
    rank's part of a batch is collated by it, and item i is the one-sample batch's row, so
    an item is an (input, target) pair whatever the dataset's own items are."""

    def __init__(self, dataset, collate_fn, loader=None):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.loader = loader  # the user's DataLoader: its workers read (data/loader.py)

    def __len__(self):
        return len(self.dataset)

    def collate_indices(self, indices):
        return as_pair(self.collate_fn([self.dataset[i] for i in indices]))

    def __getitem__(self, i):
        x, y = self.collate_indices([i])
        return take_rows(x, 0), take_rows(y, 0)


def as_pair(batch):
    """(inputs, targets) of a batch a DataLoader's collate_fn made: each a tensor, or a
    dict/tuple of tensors with one row per sample; TypeError otherwise."""
    problem = (None if isinstance(batch, (tuple, list)) and len(batch) == 2
               else f"it returned a {type(batch).__name__}, not an (inputs, targets) pair")
    problem = problem or check_batch(batch)
    if problem:
        raise TypeError(f"the DataLoader's collate_fn does not give a batch hpctrain can "
                        f"train on: {problem}. Make it return (inputs, targets): each a "
                        f"tensor, or a dict/tuple of tensors with one row per sample "
                        f"(a dict of inputs is passed to the model as keywords)")
    return batch[0], batch[1]
