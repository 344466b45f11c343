"""The training loop: global batch -> micro-batches per rank -> strategy step -> metrics."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping

import torch

from hpctrain import checkpoint
from hpctrain.config import Config
from hpctrain.errors import UsageError, as_setup_error
from hpctrain.runtime.abort import set_context
from hpctrain.runtime.flight import RECORDER
from hpctrain.runtime.run_lock import take as take_run_lock
from hpctrain.runtime.timeline import TIMELINE, merge as merge_timeline
from hpctrain.runtime.watchdog import start_watchdog
from hpctrain.data.loader import eval_source, train_reader
from hpctrain.data.sampler import GlobalBatchSampler
from hpctrain.data.structure import to_device
from hpctrain.models.registry import BuiltModel
from hpctrain.parallel.orchestrator import RunData, apply_plan, has_deferred
from hpctrain.train.build import build_model, keeps_a_part, run_dir
from hpctrain.train.checked import CheckedRun, check_run
from hpctrain.train.metrics import (SUMMARY_NAME, MetricsCSV, TensorBoardWriter,
                                    gather_peak_rss_mb, peak_rss_mb, write_summary)
from hpctrain.train.nonfinite import NonFiniteError, NonFiniteGuard
from hpctrain.train.precision import Precision
from hpctrain.train.preemption import Preemption, sigterm_grace_s
from hpctrain.train.progress import Progress
from hpctrain.train.report import report_after_training
from hpctrain.train.schedule import make_schedule
from hpctrain.train.optimizers import make_optimizer_factory
from hpctrain.train.plan_options import plan_options

__all__ = ["TrainingRun", "NonFiniteError"]


def _sizes_text(sizes: list[int]) -> str:
    """[11, 11, 10] -> '11, 11 and 10'."""
    return ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}"


class TrainingRun:
    """Train ``cfg.train.model`` under the config's ParallelPlan; ``fit()`` returns the summary.

    The global batch of each step is the same whatever the world size; each rank's
    micro-batch loss is weighted by its share of that batch, so summed gradients equal the
    single-process mean gradient.
    """

    def __init__(self, cfg: Config, world=None, built: BuiltModel | None = None,
                 callbacks=(), owner=None, validation=None, force_unlock: bool = False,
                 checked: CheckedRun | None = None):
        self.cfg = cfg
        # the run-directory lock (runtime/run_lock.py), held from _build to the end of fit()
        self.force_unlock, self.run_lock = force_unlock, None
        # (dataset, batch size, loss_fn, every N steps) evaluated during fit (train/api.py)
        self.validation, self.val_losses = validation, []
        # hpctrain.Trainer's callbacks (train/api.py), called with ``owner`` (the public
        # Trainer, whose should_stop ends training after a step)
        self.callbacks, self.owner = list(callbacks), owner if owner is not None else self
        self.should_stop = False
        if world is None:
            from hpctrain.runtime.world import init_world

            world = init_world(cfg.runtime.ranks_per_node, cfg.runtime.device)
        self.world, self.plan, self.watchdog = world, None, None
        try:
            self._build(cfg, world, built, checked)
        except BaseException as exc:
            if self.watchdog is not None:  # a caller that catches the error may train again
                self.watchdog.stop()
            self.release_lock()
            # The model or an option the plan cannot run (a strategy's check, a factory's
            # refusal): the same on every rank, so a user error (exit 2), not a crash.
            err = as_setup_error(exc, f"plan {self.plan.name!r}" if self.plan else "")
            if err is exc:
                raise
            raise err from exc
        t = cfg.train
        self.start_step, self.history = 0, []
        # Training randomness (dropout masks) from the run's seed, the same on every rank:
        # the ranks splitting a model draw whole masks alike and keep their slices
        # (models/dropout.py). A resume restores the saved state instead.
        torch.manual_seed(t.seed)
        self._save_s: float | None = None  # wall time of this run's last save
        self.guard = NonFiniteGuard(t.nonfinite, t.nonfinite_max_skips, world.mpi_comm,
                                    world.is_main, self._latest_or_none,
                                    getattr(self.par, "name_of", None))
        try:
            self._resume(cfg.checkpoint, world)
        except BaseException:
            self.release_lock()
            raise

    def _resume(self, c, world) -> None:
        """Clean what dead saves left, then load the checkpoint to resume from, if any."""
        checkpoint.clean_stale(c.dir, world.mpi_comm)  # what saves that died left behind
        resume = checkpoint.resolve_resume(c.resume, c.dir, world.mpi_comm)
        if resume:
            self.start_step, self.history = checkpoint.load_checkpoint(resume, self._run_state())
            if world.is_main:
                print(f"hpctrain: resumed from {resume} at step {self.start_step}", flush=True)

    def _run_state(self, losses=()) -> checkpoint.RunState:
        return checkpoint.RunState(self.par, self.world, self.sampler, list(losses),
                                   self.precision.scaler, self.schedule, self.cfg)

    def release_lock(self) -> None:
        """Let other runs use this run's directories (rank 0 removes its lock files)."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _build(self, cfg: Config, world, built: BuiltModel | None,
               checked: CheckedRun | None) -> None:
        """The model, the plan and the strategy, from the config (collective). ``checked``:
        what the CLI checked before MPI (the plan and the model against it), else done here."""
        if checked is None:
            plan = self.plan = cfg.check(world.size)  # errors from here on name the plan
            self.built = built if built is not None else build_model(cfg, plan=plan)
            # the model against the plan (dropout, the loss's count, the tensor and domain
            # splits): refused on every rank alike, before any collective
            checked = check_run(cfg, plan, self.built)
        else:
            if checked.plan.world_size != world.size:
                raise ValueError(f"the run was checked for {checked.plan.world_size} ranks, "
                                 f"the world has {world.size}")
            self.built = built
        # Record communication from the first collective on; the watchdog ends a stalled job
        # (runtime/flight.py, runtime/watchdog.py).
        RECORDER.enabled = cfg.runtime.flight_recorder
        if cfg.train.trace_dir:  # --trace: this rank's events, merged at the end of fit()
            TIMELINE.enable(cfg.train.trace_dir, world.rank)
        self.plan, self.weighting = checked.plan, checked.weighting
        for note in checked.notes:
            if world.is_main:
                print(note, flush=True)
        self.out_dir = run_dir(cfg, self.plan.name, world.mpi_comm)
        # Before any file is written: a directory another run writes stops every rank here.
        self.run_lock = take_run_lock(
            [("--out-dir", self.out_dir), ("--checkpoint-dir", cfg.checkpoint.dir),
             ("--trace", cfg.train.trace_dir)], world.mpi_comm, force=self.force_unlock)
        self.watchdog = start_watchdog(cfg.runtime.collective_timeout_s, self.out_dir,
                                       world.mpi_comm)
        if self.watchdog is not None:  # NCCL's own timeout must not beat its report
            world.comm.extend_op_timeout(self.watchdog.report_window_s)
        t = cfg.train
        self.precision = Precision(t.precision, world.device)
        options = plan_options(cfg, self.plan.flavour)
        if has_deferred(self.built.model) and world.is_main:
            print("hpctrain: deferred init: the model was built on the meta device; each rank "
                  "fills only the part it keeps, layer by layer", flush=True)
        elif t.deferred_init and keeps_a_part(self.plan, cfg) and world.is_main:
            print(f"hpctrain: note: model {t.model!r} was built whole on every rank before "
                  f"being split: deferred init needs a model described layer by layer (the "
                  f"built-in gpt and mlp, or a factory returning a models.layers.LayerStack); "
                  f"a factory's nn.Module exists whole once it is returned", flush=True)
        if t.global_batch_size % t.grad_accum and world.is_main:
            sizes = [len(m) for m in torch.tensor_split(torch.arange(t.global_batch_size),
                                                        t.grad_accum)]
            print(f"hpctrain: note: train.global_batch_size = {t.global_batch_size} is not a "
                  f"multiple of train.grad_accum = {t.grad_accum}: each step runs micro-batches "
                  f"of {_sizes_text(sizes)} samples, each weighted by its share of the batch "
                  f"(the same step as one batch of {t.global_batch_size})", flush=True)
        self.loss_fn = self.weighting.wrap(self.built.loss_fn)
        # what the loss averages over in a target (its own count_units, when it declares one)
        self.count = self.weighting.counter(self.built.loss_fn)
        self._check_inputs()
        # the data the transforms may look at first (the pipeline: a micro-batch to time its
        # layers on, a user module's samples to check its split; its pieces count by tokens)
        data = RunData(self.built.dataset, t.global_batch_size // t.grad_accum,
                       self.built.loss_fn, self.count if self.weighting.tokens else None)
        self.par = apply_plan(self.plan, self.built.model, make_optimizer_factory(t), world,
                               options, activation_checkpointing=t.activation_checkpointing,
                               data=data)
        self.schedule = make_schedule(self.par.optimizer, t)
        data_rank, data_ranks = self.par.data_shard(world)
        self.sampler = GlobalBatchSampler(len(self.built.dataset), t.global_batch_size, t.seed,
                                          data_rank, data_ranks, t.grad_accum)
        # reads this rank's part of each micro-batch (data/loader.py); opened at the first
        # step trained (a resumed run's), closed at the end of fit()
        self.reader = train_reader(self.built.dataset, self.sampler, t.steps, self.par)

    def _check_inputs(self) -> None:
        """Structured inputs (a dict passed as keywords, a tuple as positions) run where the
        model is called whole; the domain split cuts one input tensor, the pipeline one
        tensor or a dict its layers take (input_ids and attention_mask of a Hugging Face
        model: the split checks the keys)."""
        if not (self.plan.pipeline or self.plan.domain):
            return
        x = self.built.dataset[0][0]
        if self.plan.pipeline and isinstance(x, Mapping):
            return
        if not torch.is_tensor(x) and not isinstance(x, (int, float, list)):
            kind = "pipeline" if self.plan.pipeline else "domain"
            raise UsageError(f"plan {self.plan.name!r}: the {kind} split passes one input "
                             f"tensor through the model, but a sample's input is a "
                             f"{type(x).__name__}; give the model one tensor (e.g. input_ids), "
                             f"or use a data-parallel or tensor plan")

    def save(self, step: int, losses: list[float]) -> str:
        """Write a checkpoint of the state after `step` steps (collective).

        A model whose parameters are no longer finite is never saved: with keep-last-K the
        save would rotate out the good checkpoints (train.nonfinite = ignore: the save is
        left out and the newest good checkpoint's path returned).
        """
        norm = self.par.param_norm()
        if not math.isfinite(norm) and self.cfg.train.nonfinite == "ignore":
            if self.world.is_main:
                print(f"hpctrain: step {step}: the parameters are not finite (norm {norm}); "
                      f"no checkpoint written (train.nonfinite = ignore)", flush=True)
            return self._latest_or_none()
        if not math.isfinite(norm):
            raise NonFiniteError(
                f"step {step}: the parameters are not finite (norm {norm}); no checkpoint "
                f"written, the newest good one is {self._latest_or_none()}. Lower --lr or set "
                f"--max-grad-norm")
        c = self.cfg.checkpoint
        set_context(phase="checkpoint")
        t0 = time.perf_counter()
        path = checkpoint.save_checkpoint(c.dir, step, self._run_state(losses), c.keep)
        self._save_s = time.perf_counter() - t0
        if self.world.is_main:
            print(f"hpctrain: checkpoint written: {path}", flush=True)
        for cb in self.callbacks:
            cb.on_checkpoint(self.owner, step, path)
        return path

    def _save_estimate_s(self) -> float:
        """How long a save will take: the last one's time with a margin, else a cautious guess
        from the bytes this rank writes (parameters and two optimizer states, at 100 MB/s)."""
        if self._save_s is not None:
            return 1.5 * self._save_s + 0.5
        nbytes = sum(p.numel() * p.element_size() for p in self.par.model.parameters())
        return 1.0 + 3 * nbytes / self.world.size / 100e6

    def _stop_on_signal(self, step: int, saved_step: int, losses: list[float], preempt) -> None:
        """Checkpoint `step` unless SIGKILL would cut the save short; raise Preempted.

        Collective: the time left and the save estimate are agreed, so every rank decides alike.
        """
        ck, host = self.cfg.checkpoint, self.world.host
        path, saved = checkpoint.latest(ck.dir), True
        if saved_step != step:
            # One reduction: the least time left (as -max of -left) and the longest save.
            neg_left, need = host.allreduce_scalars(
                [-preempt.time_left_s(), self._save_estimate_s()], op="max")
            left = -neg_left
            if need <= left:
                path = self.save(step, losses)
            else:
                saved = False
                if self.world.is_main:
                    print(f"hpctrain: {left:.1f} s left before SIGKILL, a checkpoint needs "
                          f"~{need:.1f} s: not starting it (set checkpoint.sigterm_grace_s, or "
                          f"give the job more time between SIGTERM and SIGKILL)", flush=True)
        preempt.finish(step, path, host, saved)

    def _latest_or_none(self) -> str:
        c = self.cfg.checkpoint
        return (checkpoint.latest(c.dir) if c.dir else None) or "none"

    def _micro_batches(self, step: int):
        """Yield (x, y, weight) for this rank's micro-batches of `step`: weight is the
        micro-batch's share of the global batch's samples, or of its valid tokens
        (train.loss_weight = tokens: the step's micro-batches are read first, and their
        count is all-reduced once)."""
        size, device = self.cfg.train.global_batch_size, self.world.device
        loaded = self.reader.micro_batches(step)  # (x, y, samples); empty parts left out
        if self.weighting.tokens:
            loaded = list(loaded)
            counts = [self.count(y) for _, y, _ in loaded]
            weights = self.weighting.weights(counts, self._global_count(sum(counts)))
        for i, (x, y, n) in enumerate(loaded):
            weight = weights[i] if self.weighting.tokens else n / size
            yield to_device(x, device, True), to_device(y, device, True), weight

    def _global_count(self, local: int) -> float:
        """The sum of ``local`` over the distinct data parts (collective): ranks that read
        the same samples (pipeline stages, tp and dom ranks of a replica) count once."""
        _, parts = self.par.data_shard(self.world)
        copies = self.world.size // parts
        return self.world.host.allreduce_scalars([float(local)])[0] / copies

    def _device_steps(self):
        """DeviceSteps when this run's steps can be decided on the device (no host read per
        step: train/device_step.py), else None; rank 0 says which, once."""
        from hpctrain.train.device_step import DeviceSteps, unsupported

        why = unsupported(self.par, self.world, self.precision, self.callbacks, self.schedule)
        if why is not None:
            return None
        if self.world.is_main and self.world.device.type == "cuda":
            print("hpctrain: steps decided on the device (the loss and gradient norm are read "
                  "a step late; no host sync inside a step)", flush=True)
        return DeviceSteps(self.par, self.guard, self.precision, self.cfg.train.max_grad_norm)

    def _train_step(self, step: int) -> float:
        """Run one optimizer step; return the global mean loss (all-reduced before the
        optimizer steps, for the non-finite guard: train/nonfinite.py)."""
        set_context(phase="forward")  # strategies mark "backward" where it begins
        local = self.par.forward_backward(self._micro_batches(step), self.loss_fn, self.precision)
        loss = self.world.host.allreduce_scalars([local])[0]
        self.guard.step, self.guard.loss = step + 1, loss
        set_context(phase="optimizer")
        self.par.step(self.precision.scaler, self.cfg.train.max_grad_norm, guard=self.guard)
        self.schedule.step(loss)  # also after a skipped step: it counts toward train.steps
        return loss

    def fit(self) -> dict:
        """Train for cfg.train.steps steps; write metrics and the summary on rank 0; then
        release the run's directories, however training ended."""
        try:
            return self._fit()
        finally:
            self.release_lock()

    def _fit(self) -> dict:
        t, world = self.cfg.train, self.world
        main = world.is_main
        if main:
            print(world.describe(strategy=self.plan.name, mesh=self.plan.mesh_text()), flush=True)
        if self.start_step >= t.steps:
            return self._nothing_to_train()
        units_per_step = t.global_batch_size * self.built.units_per_sample
        progress = Progress(t.steps, main, t.progress, t.log_every, self.built.unit,
                            start=self.start_step)
        csv = MetricsCSV(self.out_dir, main, resume_step=self.start_step)
        events = TensorBoardWriter(self.out_dir, main and t.tensorboard)
        losses: list[float] = list(self.history)
        ck = self.cfg.checkpoint
        saved = self.start_step
        self.par.model.train()
        start = time.perf_counter()
        # A signal means checkpoint-and-stop only when there is somewhere to checkpoint to.
        grace = sigterm_grace_s(world.launch.launcher, os.environ, ck.sigterm_grace_s)
        preempt = Preemption(ck.requeue, grace_s=grace).install() if ck.dir else None
        device = self._device_steps()
        lrs, vals = {}, {}  # a step's lr and validation loss, until its row is written

        def record(step: int, loss: float, dt: float) -> None:
            """A step whose loss is known: its row, its progress, its place in losses."""
            losses.append(loss)
            progress.update(step, loss, units_per_step / dt)
            if main:
                self._log_step(csv, events, step + 1, loss, lrs.pop(step), units_per_step / dt,
                               time.perf_counter() - start, vals.pop(step, None))

        def settle() -> None:
            """Read every step still on its way (device steps) before what needs them all."""
            if device is not None:
                for got in device.read():
                    record(got.step, got.loss, got.dt)

        try:
            for step in range(self.start_step, t.steps):
                set_context(step=step + 1)
                t0 = time.perf_counter()
                lrs[step] = lr = self.par.optimizer.param_groups[0]["lr"]  # before the schedule
                if device is None:
                    loss = self._train_step(step)  # the guard stops or skips non-finite steps
                    done = [(step, loss, time.perf_counter() - t0)]
                else:  # this step queued; the previous one read (and passed by the guard)
                    done = [(g.step, g.loss, g.dt) for g in device.launch(
                        step, self._micro_batches(step), self.loss_fn)]
                    self.schedule.step(None)  # counts the step; no plateau schedule here
                if self.validation is not None and (step + 1) % self.validation[3] == 0:
                    # measured before the step's row is written: it is a column
                    vals[step] = self._validate_during_fit(step + 1, events if main else None)
                for args in done:
                    record(*args)
                self.sampler.step = step + 1
                stop = self._callbacks_stop(step + 1, loss, lr,
                                            units_per_step / done[-1][2]) if device is None else False
                if ck.dir and ck.every and (step + 1) % ck.every == 0:
                    settle()  # the guard passes every step before its state is saved
                    self.save(step + 1, losses)
                    saved = step + 1
                if stop:
                    if main:
                        print(f"hpctrain: stopped by a callback after step {step + 1}",
                              flush=True)
                    break
                if preempt is not None and step + 1 < t.steps and preempt.should_stop(world.host):
                    settle()
                    # rank 0 requeues the SLURM job; every rank raises Preempted (exit 75)
                    self._stop_on_signal(step + 1, saved, losses, preempt)
            settle()
            set_context(step=None)
            last = self.start_step + len(losses) - len(self.history)
            if ck.dir and saved != last:
                self.save(last, losses)
            set_context(phase=None)
        finally:
            self.reader.close()  # the loader's workers, also when a step failed
            if TIMELINE.enabled:  # this rank's file, also when a rank fails (its last events)
                TIMELINE.write()
            if self.watchdog is not None:
                self.watchdog.stop()
            if preempt is not None:
                preempt.restore()
            progress.close()
            csv.close()
            events.close()
        elapsed = time.perf_counter() - start
        if t.trace_dir:
            world.host.barrier()  # every rank's file is written
            if main:
                print(f"hpctrain: timeline written: {merge_timeline(t.trace_dir, world.size)} "
                      f"(chrome://tracing or ui.perfetto.dev)", flush=True)
        trained = len(losses) - len(self.history)  # fewer than asked when a callback stopped
        summary = self._summary(losses, trained, elapsed)
        if self.validation is not None:
            summary["val_losses"] = self.val_losses
        if main:
            print(f"done: {self.start_step + trained} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                  f"{summary['tokens_or_samples_per_s']:,.0f} {self.built.unit}/s, "
                  f"peak RSS {summary['peak_rss_mb']:.0f} MiB/rank", flush=True)
            if t.summary:
                write_summary(t.summary, summary)
            if self.out_dir:  # next to metrics.csv: `hpctrain report` redraws from these files
                write_summary(os.path.join(self.out_dir, SUMMARY_NAME), summary)
                if t.report:
                    report_after_training(self.out_dir)  # a failed picture is only a warning
        return summary

    def _log_step(self, csv, events, step: int, loss: float, lr: float, units_per_s: float,
                  elapsed_s: float, val_loss: float | None = None) -> None:
        """One row of metrics.csv and the step's TensorBoard scalars (rank 0). grad_norm
        comes from clipping or the non-finite guard (the global norm, the same on every
        rank): no communication of its own. val_loss: the step's validation, if one ran."""
        norm, rss = self.guard.norm, peak_rss_mb()
        csv.write(step=step, loss=f"{loss:.8g}", lr=lr, units_per_s=f"{units_per_s:.6g}",
                  elapsed_s=f"{elapsed_s:.4f}", grad_norm="" if norm is None else f"{norm:.8g}",
                  peak_rss_mb=f"{rss:.1f}",
                  val_loss="" if val_loss is None else f"{val_loss:.8g}")
        events.write(step, {"loss": loss, "lr": lr, "grad_norm": norm,
                            f"throughput_{self.built.unit}_per_s": units_per_s,
                            "peak_rss_mb": rss})

    def evaluate(self, dataset, batch_size: int, loss_fn) -> float:
        """The mean loss of the model over ``dataset``, in order, in global batches of
        ``batch_size`` (each batch's loss weighted by its size, as one process computes it).
        Each data-parallel rank forwards its part of every batch (an empty part too: a
        sharded forward gathers with the others) through the plan's forward-only path
        (``forward_loss``: the pipeline's forward schedule, tensor and domain executors);
        one reduction at the end. Collective. The same value under every plan.
        ``dataset`` may be a validation source over a DataLoader instead (data/loader.py:
        its workers, or a stream whose size is counted as it is read)."""
        rank, ranks = self.par.data_shard(self.world)
        model, device = self.par.model, self.world.device
        source = eval_source(dataset, batch_size)
        loss_fn, count = self.weighting.wrap(loss_fn), self.weighting.counter(loss_fn)
        was_training = model.training
        model.eval()
        total = units = 0.0
        try:
            for x, y, k, _ in source.parts(rank, ranks, self.par):
                c = count(y) if k else 0  # samples, or valid tokens: what the loss averages
                total += self.par.forward_loss([(to_device(x, device), to_device(y, device),
                                                 c)], loss_fn, self.precision)
                units += c
        finally:
            model.train(was_training)
        # the loss is reported once per sample (tp rank 0, the last stage); counts by all
        total, units = self.world.host.allreduce_scalars([total, units])
        units /= self.world.size // ranks
        return total / units if units else float("nan")

    def _validate_during_fit(self, step: int, events) -> float:
        dataset, batch_size, loss_fn, _ = self.validation
        set_context(phase="validation")
        loss = self.evaluate(dataset, batch_size, loss_fn)
        self.val_losses.append((step, loss))
        if self.world.is_main:
            print(f"hpctrain: step {step}: validation loss {loss:.6g}", flush=True)
            if events is not None:
                events.write(step, {"val_loss": loss})
        for cb in self.callbacks:
            cb.on_validation_end(self.owner, step, {"val_loss": loss})
        return loss

    def _callbacks_stop(self, step: int, loss: float, lr: float, rate: float) -> bool:
        """Call on_step_end of every callback; True when one asked to stop. The ranks agree
        (one scalar reduction, only when there are callbacks): a callback that decides from
        anything but the reduced metrics must not leave ranks in different steps."""
        if not self.callbacks:
            return False
        metrics = {"loss": loss, "lr": lr, "units_per_s": rate, "grad_norm": self.guard.norm}
        for cb in self.callbacks:
            cb.on_step_end(self.owner, step, metrics)
        asked = bool(getattr(self.owner, "should_stop", False) or self.should_stop)
        return self.world.host.allreduce_scalars([float(asked)], op="max")[0] > 0

    def _nothing_to_train(self) -> dict:
        """The resumed checkpoint is already at or past train.steps: report it, train nothing."""
        t = self.cfg.train
        summary = self._summary(list(self.history), 0, 0.0)
        if self.world.is_main:
            print(f"hpctrain: the checkpoint is at step {self.start_step}, already at or past "
                  f"train.steps = {t.steps}; nothing to train (raise --steps to continue)",
                  flush=True)
            if t.summary:
                write_summary(t.summary, summary)
        return summary

    def _summary(self, losses: list[float], trained_steps: int, elapsed: float) -> dict:
        """The run's JSON summary (collective: norms and peak RSS are reduced over ranks).

        Throughput counts only the steps this run trained; None when it trained none.
        """
        t, world = self.cfg.train, self.world
        units = t.global_batch_size * self.built.units_per_sample * trained_steps
        peak_per_rank = gather_peak_rss_mb(world.host)
        return {
            "strategy": self.plan.name,
            "world_size": world.size,
            "steps": self.start_step + trained_steps,
            "trained_steps": trained_steps,
            "nonfinite_skipped_steps": self.guard.skipped,  # train.nonfinite = skip
            "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "param_norm": self.par.param_norm(),
            "buffer_norm": self.par.buffer_norm(),
            "tokens_or_samples_per_s": units / elapsed if trained_steps and elapsed > 0 else None,
            "unit": self.built.unit,
            "peak_rss_mb": max(peak_per_rank),
            "peak_rss_mb_per_rank": peak_per_rank,
            "model": self.built.name,
            "precision": t.precision,
            "global_batch_size": t.global_batch_size,
            "grad_accum": t.grad_accum,
            # what `hpctrain report` names when overlaid runs differ (train/report.py)
            "lr": t.lr,
            "lr_schedule": t.lr_schedule,
            "max_grad_norm": t.max_grad_norm,
            "seed": t.seed,
            "elapsed_s": elapsed,
        }
