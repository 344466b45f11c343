"""The training loop: global batch -> micro-batches per rank -> strategy step -> metrics."""

from __future__ import annotations

import time

import torch

from hpctrain import checkpoint, parallel
from hpctrain.config import Config
from hpctrain.data.sampler import GlobalBatchSampler, collate
from hpctrain.models.registry import BuiltModel, build, build_layers
from hpctrain.train.activation_checkpointing import checkpoint_blocks
from hpctrain.train.metrics import MetricsCSV, peak_rss_mb, write_summary
from hpctrain.train.precision import Precision
from hpctrain.train.preemption import Preemption
from hpctrain.train.progress import Progress
from hpctrain.train.strategy import make_optimizer_factory, strategy_options

__all__ = ["Trainer", "build_model"]


def build_model(cfg: Config, world_size: int | None = None) -> BuiltModel:
    """Build model, data set and loss from the config (no communication; raises ValueError).

    The pipeline strategy gets a LayerStack instead of a model (each rank builds only its
    stage); with world_size given, a split that cannot fit is reported here, before MPI.
    """
    t = cfg.train
    if t.strategy == "pipeline":
        built = build_layers(t.model, t.seed, **t.model_options)
        if world_size is not None:
            from hpctrain.parallel.pipeline import check_fits, resolve_layout

            pl = cfg.pipeline
            v = pl.virtual_stages if pl.schedule == "interleaved-1f1b" else 1
            check_fits(len(built.model), resolve_layout(cfg.runtime.mesh, world_size).pp, v,
                       pl.schedule)
        return built
    return build(t.model, t.seed, **t.model_options)


class Trainer:
    """Train ``cfg.train.model`` with ``cfg.train.strategy``; ``fit()`` returns the summary dict.

    The global batch of each step is the same whatever the world size; each rank's
    micro-batch loss is weighted by its share of that batch, so summed gradients equal the
    single-process mean gradient.
    """

    def __init__(self, cfg: Config, world=None, built: BuiltModel | None = None):
        self.cfg = cfg
        self.built = built if built is not None else build_model(cfg)
        if world is None:
            from hpctrain.runtime.world import init_world

            world = init_world(cfg.runtime.ranks_per_node, cfg.runtime.device)
        self.world = world
        cfg.validate(world.size)
        t = cfg.train
        if t.activation_checkpointing and t.strategy != "pipeline":  # pipeline: per layer
            checkpoint_blocks(self.built.model)
        self.precision = Precision(t.precision, world.device)
        options = strategy_options(cfg)
        if t.strategy == "pipeline" and cfg.pipeline.balance == "measured":
            n = t.global_batch_size // (t.grad_accum * cfg.pipeline.microbatches)
            x, y = collate(self.built.dataset, range(max(1, n)))
            options.sample, options.sample_target = x.to(world.device), y.to(world.device)
            options.loss_fn = self.built.loss_fn
        self.par = parallel.wrap(t.strategy, self.built.model, make_optimizer_factory(t), world,
                                 options)
        data_rank, data_ranks = self.par.data_shard(world)
        self.sampler = GlobalBatchSampler(len(self.built.dataset), t.global_batch_size, t.seed,
                                          data_rank, data_ranks, t.grad_accum)
        self.start_step, self.history = 0, []
        c = cfg.checkpoint
        checkpoint.clean_stale(c.dir, world.mpi_comm)  # what saves that died left behind
        resume = checkpoint.resolve_resume(c.resume, c.dir, world.mpi_comm)
        if resume:
            self.start_step, self.history = checkpoint.load_checkpoint(
                resume, self.par, world, self.sampler, self.precision.scaler)
            if world.is_main:
                print(f"hpctrain: resumed from {resume} at step {self.start_step}", flush=True)

    def save(self, step: int, losses: list[float]) -> str:
        """Write a checkpoint of the state after `step` steps (collective)."""
        c = self.cfg.checkpoint
        return checkpoint.save_checkpoint(c.dir, step, self.par, self.world, self.cfg, self.sampler,
                                          losses, self.precision.scaler, c.keep)

    def _micro_batches(self, step: int):
        """Yield (x, y, weight) for this rank's micro-batches of `step`."""
        t, b = self.cfg.train, self.built
        for indices in self.sampler.micro_batches(step):
            weight = len(indices) / t.global_batch_size
            if weight == 0:
                continue
            x, y = self.par.load_batch(b.dataset, indices)
            yield (x.to(self.world.device, non_blocking=True),
                   y.to(self.world.device, non_blocking=True), weight)

    def _train_step(self, step: int) -> float:
        """Run one optimizer step; return this rank's weighted share of the global mean loss."""
        local = self.par.forward_backward(self._micro_batches(step), self.built.loss_fn, self.precision)
        self.par.step(self.precision.scaler, self.cfg.train.max_grad_norm)
        return local

    def fit(self) -> dict:
        """Train for cfg.train.steps steps; write metrics and the summary on rank 0."""
        t, world = self.cfg.train, self.world
        main = world.is_main
        if main:
            print(world.describe(strategy=t.strategy, mesh=self.cfg.effective_mesh(world.size)),
                  flush=True)
        units_per_step = t.global_batch_size * self.built.units_per_sample
        progress = Progress(t.steps, main, t.progress, t.log_every, self.built.unit)
        csv = MetricsCSV(t.out_dir, main)
        losses: list[float] = list(self.history)
        ck = self.cfg.checkpoint
        saved = self.start_step
        self.par.model.train()
        start = time.perf_counter()
        # A signal means checkpoint-and-stop only when there is somewhere to checkpoint to.
        preempt = Preemption(ck.requeue).install() if ck.dir else None
        try:
            for step in range(self.start_step, t.steps):
                t0 = time.perf_counter()
                local = self._train_step(step)
                loss = world.host.allreduce_scalars([local])[0]
                dt = time.perf_counter() - t0
                losses.append(loss)
                lr = self.par.optimizer.param_groups[0]["lr"]
                progress.update(step, loss, units_per_step / dt)
                csv.write(step=step + 1, loss=f"{loss:.8g}", lr=lr, units_per_s=f"{units_per_step / dt:.6g}",
                          elapsed_s=f"{time.perf_counter() - start:.4f}")
                self.sampler.step = step + 1
                if ck.dir and ck.every and (step + 1) % ck.every == 0:
                    self.save(step + 1, losses)
                    saved = step + 1
                if preempt is not None and step + 1 < t.steps and preempt.should_stop(world.host):
                    path = self.save(step + 1, losses) if saved != step + 1 else \
                        checkpoint.latest(ck.dir)
                    # rank 0 requeues the SLURM job; every rank raises Preempted (exit 75)
                    preempt.finish(step + 1, path, world.host)
            if ck.dir and saved != t.steps and self.start_step < t.steps:
                self.save(t.steps, losses)
        finally:
            if preempt is not None:
                preempt.restore()
            progress.close()
            csv.close()
        elapsed = time.perf_counter() - start
        summary = {
            "strategy": t.strategy,
            "world_size": world.size,
            "steps": t.steps,
            "losses": losses,
            "final_loss": losses[-1],
            "param_norm": self.par.param_norm(),
            "buffer_norm": self.par.buffer_norm(),
            "tokens_or_samples_per_s": units_per_step * max(1, t.steps - self.start_step) / elapsed,
            "unit": self.built.unit,
            "peak_rss_mb": world.host.allreduce_scalars([peak_rss_mb()], op="max")[0],
            "model": self.built.name,
            "precision": t.precision,
            "global_batch_size": t.global_batch_size,
            "grad_accum": t.grad_accum,
            "elapsed_s": elapsed,
        }
        if main:
            print(f"done: {t.steps} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"{summary['tokens_or_samples_per_s']:,.0f} {self.built.unit}/s, "
                  f"peak RSS {summary['peak_rss_mb']:.0f} MiB/rank", flush=True)
            if t.summary:
                write_summary(t.summary, summary)
        return summary
