"""Reading a user's torch DataLoader (hpctrain.Trainer.fit, train/api.py).

Training asks a reader for this rank's micro-batches of a step, ``(x, y, n)`` with ``n``
the samples it holds; validation asks a source for this rank's part of every global batch,
``(x, y, n, rows)`` with ``rows`` the whole batch's size. Three ways to read:

* ``IndexReader`` / ``MapEval``: a map-style data set collated in this process;
* ``WorkerReader`` / ``WorkerEval``: a map-style data set read by worker processes set up
  as the user's loader's (``num_workers`` > 0): this rank's index lists, in order, are
  their batch_sampler, so they prefetch ahead across steps;
* ``StreamReader`` / ``StreamEval``: an IterableDataset's loader, iterated whole by every
  rank; each batch it yields is one global batch, of which each rank keeps its rows.

Whatever read the rows, they go through the strategy's ``load_batch`` (the domain executor
keeps its tile of each sample) as a TensorPairDataset.
"""

import copy

import torch
from torch.utils.data import DataLoader, IterableDataset

from .sampler import CollatedDataset, as_pair, collate, split_global_batch
from .structure import rows as count_rows
from .synthetic import TensorPairDataset

__all__ = ["train_reader", "validation_source", "eval_source", "StreamDataset",
           "IndexReader", "WorkerReader", "StreamReader", "MapEval", "WorkerEval", "StreamEval"]

_MASK64 = (1 << 64) - 1


def train_reader(dataset, sampler, steps, par):
    """The reader of the engine's training data (built.dataset): a stream's, the user's
    workers', or this process's."""
    if isinstance(dataset, StreamDataset):
        return StreamReader(dataset.loader, sampler, par)
    loader = getattr(dataset, "loader", None)
    if loader is not None and loader.num_workers > 0:
        return WorkerReader(loader, sampler, steps, par)
    return IndexReader(dataset, sampler, par)


def validation_source(loader, batch_size):
    """The validation source of a user's DataLoader (global batches of ``batch_size``)."""
    if isinstance(loader.dataset, IterableDataset):
        return StreamEval(loader)
    if loader.num_workers > 0:
        return WorkerEval(loader, batch_size)
    return MapEval(CollatedDataset(loader.dataset, loader.collate_fn), batch_size)


def eval_source(data, batch_size):
    """``data`` if it is a validation source already, else one over the map-style data set."""
    return data if hasattr(data, "parts") else MapEval(data, batch_size)


def read(par, x, y, rows=None):
    """The strategy's read of collated rows (all of them, or the indices ``rows``)."""
    return par.load_batch(TensorPairDataset(x, y), range(count_rows(x)) if rows is None else rows)


def worker_loader(loader, index_lists, seed):
    """A DataLoader over ``loader``'s map-style data set, its collate_fn and its worker
    settings, reading the batches ``index_lists`` in order. Its own generator: the workers'
    seeds must not come from (and advance) the run's global RNG."""
    options = dict(num_workers=loader.num_workers, pin_memory=loader.pin_memory,
                   timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                   multiprocessing_context=loader.multiprocessing_context,
                   persistent_workers=loader.persistent_workers)
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, batch_sampler=index_lists, collate_fn=loader.collate_fn,
                      generator=torch.Generator().manual_seed(seed & _MASK64), **options)


def release(loader):
    """Shut down the workers a persistent_workers loader keeps between passes."""
    it = getattr(loader, "_iterator", None)
    if it is not None:
        OpenIterator.shutdown(it)
        loader._iterator = None


class OpenIterator:
    """One pass over a DataLoader yielding (x, y) pairs; ``close()`` shuts its workers down
    now (a DataLoader does it only when its iterator is exhausted or garbage collected)."""

    def __init__(self, loader):
        self.loader = loader
        # iter() draws the workers' base seed from the global RNG when the loader has no
        # generator: the run's RNG (dropout, checkpoints) must not depend on the reading.
        with torch.random.fork_rng(devices=[]):
            self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        return as_pair(next(self._it))

    def close(self):
        it, self._it = self._it, None
        if it is not None:
            self.shutdown(it)
            if getattr(self.loader, "_iterator", None) is it:
                self.loader._iterator = None  # else the next pass would reuse dead workers

    @staticmethod
    def shutdown(it):
        stop = getattr(it, "_shutdown_workers", None)  # only multi-process iterators
        if stop is not None:
            stop()


# -- training --

class IndexReader:
    """This rank's micro-batches of a map-style data set, collated in this process."""

    def __init__(self, dataset, sampler, par):
        self.dataset, self.sampler, self.par = dataset, sampler, par

    def micro_batches(self, step):
        for indices in self.sampler.micro_batches(step):
            if len(indices):
                yield (*self.par.load_batch(self.dataset, indices), len(indices))

    def close(self):
        pass


class WorkerReader:
    """This rank's micro-batches of a map-style data set read by the user's loader's worker
    processes, from the first step asked for (a resumed run's) to ``steps``, prefetched
    across steps. Empty parts are skipped, never collated."""

    def __init__(self, loader, sampler, steps, par):
        self.loader, self.sampler, self.steps, self.par = loader, sampler, steps, par
        self._it, self._next = None, None  # the open pass, and the step it reads next

    def micro_batches(self, step):
        if step != self._next:
            self._open(step)
        self._next = None  # a step left half-read reopens at the next call
        for indices in self.sampler.micro_batches(step):
            if len(indices):
                yield (*read(self.par, *next(self._it)), len(indices))
        self._next = step + 1

    def _open(self, step):
        self.close()
        lists = _index_lists(copy.copy(self.sampler), step, max(self.steps, step + 1))
        seed = self.sampler.seed * 1000003 + step
        self._it = OpenIterator(worker_loader(self.loader, lists, seed))

    def close(self):
        if self._it is not None:
            self._it.close()
        self._it, self._next = None, None


def _index_lists(sampler, start, stop):
    """This rank's non-empty index lists of steps start..stop-1, in order (generated as
    the loader asks: a long run's lists are not all held at once)."""
    for step in range(start, stop):
        for indices in sampler.micro_batches(step):
            if len(indices):
                yield indices.tolist()


class StreamDataset(TensorPairDataset):
    """An IterableDataset's DataLoader as the engine's data set: map-style over the rows of
    the stream's first batch (for shapes, units, a pipeline's sample; read in this process,
    no workers), and ``loader``, what training iterates (StreamReader)."""

    def __init__(self, loader):
        peek = OpenIterator(DataLoader(loader.dataset, batch_size=loader.batch_size,
                                       collate_fn=loader.collate_fn))
        try:
            x, y = next(peek)
        except StopIteration:
            raise ValueError("the DataLoader's IterableDataset yielded nothing") from None
        finally:
            peek.close()
        super().__init__(x, y)
        self.loader = loader


class StreamReader:
    """Global step k's batch is the k-th full batch of the user's DataLoader over an
    IterableDataset, iterated by every rank, pass after pass; this rank keeps its rows of
    each micro-batch, split as GlobalBatchSampler splits indices. A run starting at step s
    (a resume) reads and drops the s batches before it."""

    def __init__(self, loader, sampler, par):
        self.loader, self.sampler, self.par = loader, sampler, par
        self._batches, self._next = None, None

    def micro_batches(self, step):
        if step != self._next:
            self._open(step)
        self._next = None  # a step left half-read reopens at the next call
        x, y = next(self._batches)
        s = self.sampler
        for rows in split_global_batch(torch.arange(count_rows(x)), s.grad_accum, s.rank,
                                       s.world_size):
            if len(rows):
                yield (*read(self.par, x, y, rows), len(rows))
        self._next = step + 1

    def _open(self, step):
        self.close()
        self._batches = FullBatches(self.loader, self.sampler.global_batch_size)
        for _ in range(step):
            next(self._batches)

    def close(self):
        if self._batches is not None:
            self._batches.close()
        self._batches, self._next = None, None


class FullBatches:
    """The batches of ``size`` rows a DataLoader yields, pass after pass without end; shorter
    ones (a pass's last, each worker's last) are dropped, as drop_last would."""

    def __init__(self, loader, size):
        self.loader, self.size = loader, size
        self._pass, self._full = None, 0  # the open pass, and its full batches so far

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self._pass is None:
                self._pass, self._full = OpenIterator(self.loader), 0
            try:
                x, y = next(self._pass)
            except StopIteration:
                self._pass = None  # its workers have exited (persistent ones wait for the next)
                if not self._full:
                    raise ValueError(f"a pass over the DataLoader's IterableDataset gave no "
                                     f"batch of {self.size} rows (the global batch); fix: a "
                                     f"longer stream or a smaller batch_size") from None
                continue
            n = count_rows(x)
            if n > self.size:
                raise ValueError(f"the DataLoader yielded a batch of {n} rows, more than its "
                                 f"batch_size {self.size}; fix: a collate_fn that keeps one "
                                 f"row per sample")
            if n == self.size:
                self._full += 1
                return x, y

    def close(self):
        if self._pass is not None:
            self._pass.close()
            self._pass = None
        release(self.loader)


# -- validation --

def _eval_parts(n, batch_size, rank, ranks):
    """[(this rank's indices, the batch's size)] of n samples in global batches, in order:
    every ranks-th sample of each batch (some parts are empty)."""
    return [(list(range(start, min(start + batch_size, n)))[rank::ranks],
             min(batch_size, n - start)) for start in range(0, n, batch_size)]


class MapEval:
    """Validation over a map-style data set collated in this process."""

    def __init__(self, dataset, batch_size):
        self.dataset, self.batch_size = dataset, batch_size

    def parts(self, rank, ranks, par):
        for mine, rows in _eval_parts(len(self.dataset), self.batch_size, rank, ranks):
            yield (*par.load_batch(self.dataset, mine), len(mine), rows)

    def close(self):
        pass


class WorkerEval(MapEval):
    """MapEval read by worker processes set up as the user's loader's. An empty part is
    made here from one sample's shapes: the collate_fn never gets []."""

    def __init__(self, loader, batch_size):
        super().__init__(CollatedDataset(loader.dataset, loader.collate_fn), batch_size)
        self.loader, self._kept, self._empty = loader, {}, None

    def parts(self, rank, ranks, par):
        parts = _eval_parts(len(self.dataset), self.batch_size, rank, ranks)
        it = OpenIterator(self._workers(rank, ranks, [m for m, _ in parts if m]))
        done = False
        try:
            for mine, rows in parts:
                x, y = next(it) if mine else self._empty_pair()
                yield (*read(par, x, y), len(mine), rows)
            done = True
        finally:
            if not done:
                it.close()

    def _workers(self, rank, ranks, lists):
        """A worker DataLoader for these lists; kept for the next validation when its
        workers persist."""
        if not self.loader.persistent_workers:
            return worker_loader(self.loader, lists, 0)
        if (rank, ranks) not in self._kept:
            self._kept[rank, ranks] = worker_loader(self.loader, lists, 0)
        return self._kept[rank, ranks]

    def _empty_pair(self):
        if self._empty is None:
            self._empty = collate(self.dataset, [])
        return self._empty

    def close(self):
        for loader in self._kept.values():
            release(loader)
        self._kept.clear()


class StreamEval:
    """Validation over an IterableDataset's DataLoader: every rank iterates it whole and
    takes every ranks-th row of each batch (short ones too), as MapEval splits samples."""

    def __init__(self, loader):
        # A copy with no iterator of its own yet: with persistent_workers, iterating the
        # user's object would reset the pass training has open when the same loader is
        # given for both.
        self.loader = copy.copy(loader)
        self.loader._iterator = None

    def parts(self, rank, ranks, par):
        it, done = OpenIterator(self.loader), False
        try:
            for x, y in it:
                mine = torch.arange(count_rows(x))[rank::ranks]
                yield (*read(par, x, y, mine), len(mine), count_rows(x))
            done = True
        finally:
            if not done:
                it.close()

    def close(self):
        release(self.loader)
