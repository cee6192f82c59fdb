"""The training loop's bookkeeping, written once: epochs, resume, step counting, saves, export.

A recipe's loop keeps in view what is about its workload and hands the rest to a `TrainLoop`:

    run = Run.open(accelerator, plan, schedule, RunConfig("mine", config), output_dir=output_dir)
    loop = TrainLoop(accelerator, plan, train_loader, schedule, run, LoopPolicy())
    for epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
            if loop.eval_due():  # every --eval-every optimizer steps
                loop.log_eval(evaluate(model, test_loader))
        loop.end_epoch(evaluate(model, test_loader))
    return loop.finish(model)

All in that order, in the recipe's own loop: no callbacks. The run's identity, folder, saves,
exports and EMA (`loop.ema`: training.ema) are the `Run`'s (training.run). `batches()` does its
bookkeeping when the recipe asks for the next batch (after the previous one's optimizer step):

- every micro-batch: count the samples seen in this epoch (the resume position);
- after a micro-batch that ends an accumulation window (an optimizer step happened): step the
  LR scheduler once, count the optimizer step, update the EMA, log loss / LR / grad norm /
  samples/s every `log_every` steps, save resumable state every `save_every` steps;
- when the run's optimizer steps are done, stop in the middle of the epoch, so the final
  checkpoint records exactly where it ended; accumulation windows run across epoch ends.
- in the run's first optimizer step: count its FLOPs (for TFLOP/s, MFU: throughput.py).

With `monitor="val_mae"` (lower is better), `end_epoch(metrics, model)` and `log_eval(metrics,
model)` keep an export of the best model (`OUTPUT/best`), and `finish` exports that one; with
`patience` N, the run stops after N evaluations without improvement (not before epoch
`min_epochs` + 1). Both decide from the value the main process holds, broadcast to all, so
every process stops at the same step; a resume restores best and count.

`epochs()` sets the epoch on the loader and a dataset with `set_epoch` (so epoch-dependent
samples match on 1 or N processes), and skips what a resumed run trained on. A run resumed after
it had finished yields no epoch and `finish` leaves its export as it was (it says so); only if
that export is missing (a crash between the final save and the export) does it yield one epoch
with no batches, so the recipe's evaluation runs again and the export carries its metrics. The
logged means' running sums are checkpointed (a resumed epoch's train_loss is the uninterrupted
run's). A NaN metric stops the run like a NaN loss.

Runs heal themselves (docs/multinode.md, "Recovery"): at the end of every optimizer step the
processes all-reduce one small flag vector (any non-finite loss in the step, any stop signal
received), so every process sees the same answer at the same step:

- a non-finite loss stops the run there (`on_nonfinite="stop"`), naming the step, the
  processes and the last good checkpoint; with `"skip"` the gradients are checked in
  `clip_gradients` and a step whose gradients are non-finite on any process is skipped on all;
- SIGTERM or SIGUSR1 (a scheduler's warning) lets every process finish the optimizer step in
  progress, saves it, and raises `Preempted` (exit code 75: requeue me);
- a process the launcher restarted (torchrun / `accelerate launch --max_restarts`, or a SLURM
  requeue) resumes from the newest complete checkpoint without being told to.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader

from accel_common.batch_lr.balance import find_balanced_sampler, imbalance
from accel_common.batch_lr.batching import BatchPlan
from accel_common.batch_lr.lr import LRSchedule
from accel_common.checkpoints.export import read_export_metadata
from accel_common.console import say
from accel_common.data.loaders import FetchRngLog, fetched_ahead
from accel_common.errors import Preempted
from accel_common.monitoring.sync_wait import SyncWaitTimer, timing_requested
from accel_common.monitoring.tracking import StepLogger
from accel_common.training.evaluation import check_eval_metrics, evaluation_generator
from accel_common.training.nonfinite import all_finite, diverged, nonfinite_losses, reduce_flags
from accel_common.training.policy import LoopPolicy, OnNonFinite
from accel_common.training.run import BEST_DIR, Run
from accel_common.training.stop_signals import StopSignals


class TrainLoop:
    """One training run's step bookkeeping (the module docstring shows its loop). Create it
    after `Run.open` (which resumed the run, if asked): it catches stop signals until `finish`.
    Every process must create it and run the same loop: saves and logging are collective."""

    def __init__(
        self,
        accelerator: Accelerator,
        plan: BatchPlan,
        loader: DataLoader,
        schedule: LRSchedule,
        run: Run,
        policy: LoopPolicy = LoopPolicy(),
    ) -> None:
        policy.check(accelerator)
        self.accelerator, self.plan, self.loader, self.run = accelerator, plan, loader, run
        self.ema = run.ema  # `with loop.ema.applied():` evaluates the EMA of the weights
        self.scheduler, self.total_steps = schedule.scheduler, schedule.total_steps
        self.policy, self.stopping = policy, policy.early_stopping
        self.clip_grad, self.on_nonfinite = policy.clip_grad, policy.on_nonfinite
        self.progress = run.progress
        self.metrics: dict[str, float] = {}
        self._timing_since: float | None = None  # inside batches(): training time runs
        self._epoch_number = 0
        self._finished_before_epoch = False
        self._grad_norm: torch.Tensor | None = None
        self._recorded = False
        self._booked: bool | None = None  # eval_due took the micro-batch's bookkeeping: done?
        self._window_losses: list[torch.Tensor] = []  # this optimizer step's, logged once it ends
        self._window_items: list[torch.Tensor | int | None] = []  # what each loss is a mean over
        self._flags: tuple[int, int] | None = None  # reduced early by clip_gradients (skip mode)
        self._skip_step = False
        # a loader balanced by cost knows every process's cost per micro-step: logged as the
        # step's imbalance, with no collective (balance.py)
        self.balanced = find_balanced_sampler(loader) if plan.num_processes > 1 else None
        self._window_costs: np.ndarray | None = None
        self._imbalances: list[float] = []
        # the benchmark's timing of the gradient all-reduce, attached to the model in
        # clip_gradients (Accelerate does not keep the DDP wrapper it prepared)
        timed = timing_requested() and accelerator.num_processes > 1
        self.sync_timer = SyncWaitTimer() if timed else None
        self.stop_signals = StopSignals()
        self.stop_signals.catch()
        self.log = StepLogger(
            accelerator,
            total_steps=self.total_steps,
            initial_step=self.progress.step,
            log_every=policy.saves.log_every,
            global_batch_size=plan.global_batch_size,
            desc=run.recipe,
        )
        if self.progress.step and run.finished_export is None:
            self._restore_loss_sums()

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by a resume)."""
        return self.progress.step

    @property
    def train_seconds(self) -> float:
        """Seconds spent training so far, over every launch of the run (checkpointed)."""
        self._count_time()
        return self.progress.train_seconds

    def _count_time(self) -> None:
        if self._timing_since is not None:
            now = time.perf_counter()
            self.progress.train_seconds += now - self._timing_since
            self._timing_since = now

    def eval_generator(self, *, per_process: bool = True) -> torch.Generator:
        """A CPU generator for this evaluation's random draws (sampling noise, random baselines),
        seeded by --seed, the step evaluated and (unless `per_process=False`) the process index:
        what it draws depends only on the step scored, not on how many evaluations this process
        ran before, so a resumed run exports the uninterrupted one's metrics. The global RNG
        (dropout, restored by a resume) is left alone."""
        index = self.accelerator.process_index if per_process else 0
        seed = int(self.run.config.values.get("seed", 0))
        return evaluation_generator(seed, self.step, index)

    @property
    def done(self) -> bool:
        """Whether the run has taken all its optimizer steps, or stopped early."""
        return self.progress.step >= self.total_steps or self.progress.stopped

    # ----------------------------------------------------------------------- the loop itself

    def epochs(self) -> Iterator[int]:
        """Epoch numbers (from 1) until the run's optimizer steps are done: at least one, but
        none for a resumed run that had finished and exported (`Run.finished_export`)."""
        if self.run.finished_export is not None:
            return
        while True:
            before = (self.progress.step, self.progress.epoch)
            self._epoch_number = self.progress.epoch + 1
            self._finished_before_epoch = self.done
            yield self._epoch_number
            if self.done:
                return
            if (self.progress.step, self.progress.epoch) == before:
                raise RuntimeError("TrainLoop: an epoch ended without a pass over loop.batches()")

    def batches(self) -> Iterator[Any]:
        """This epoch's micro-batches for this process, with the bookkeeping between them."""
        if self.done:
            return
        epoch = self.progress.epoch
        self.loader.set_epoch(epoch)
        # Accelerate passes the epoch to the dataset only when the sampler has no set_epoch
        dataset = getattr(self.loader, "dataset", None)
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        batches = self.loader
        skip = self.progress.batches_to_skip(self.plan, self.loader)  # checks it against the data
        if skip:  # resumed mid-epoch: skip what was already trained on
            if isinstance(dataset, FetchRngLog):  # the batch fetched ahead of the save, exactly
                dataset.resume_at(skip, self.run.resumed_state)
            batches = self.accelerator.skip_first_batches(self.loader, skip)
        self._timing_since = time.perf_counter()
        try:
            for batch in batches:
                self.log.flops.begin()  # the launch's first optimizer step only
                yield batch
                done = self._after_micro_batch() if self._booked is None else self._booked
                self._booked = None
                if done:
                    break  # the epoch stays unfinished: the final checkpoint records where
            else:
                self.progress.finish_epoch(self.plan)
        finally:
            self.log.flops.pause()  # a body that raised: stop counting
            self._count_time()
            self._timing_since = None

    def clip_gradients(self, model: torch.nn.Module) -> None:
        """Call between `backward` and `optimizer.step()`: on the micro-batch that ends an
        accumulation window, clip the gradient norm to `clip_grad` (if set) and keep the norm
        for logging (measured only on logging steps when not clipping). Elsewhere a no-op:
        clipping a partial sum of gradients would change the update. With
        `on_nonfinite="skip"` it also decides, on every process alike, whether this step is
        taken: a non-finite gradient norm anywhere drops every gradient, so `optimizer.step()`
        leaves the weights and the optimizer state as they are (fp16: the loss scaler does)."""
        self.log.flops.pause()  # the optimizer step is not counted
        if self.sync_timer is not None:
            self.sync_timer.backward_done()
            self.sync_timer.attach(model)  # times every later step (the first is never logged)
        if not self.accelerator.sync_gradients:
            return
        skip_mode = self.on_nonfinite is OnNonFinite.skip and self.accelerator.scaler is None
        if self.clip_grad > 0:
            self._grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.clip_grad)
        elif skip_mode or self.log.logs_at(self.progress.step + 1):
            self._grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))
        if skip_mode:
            self._flags = self._reduce_flags(self._grad_norm)
            self._skip_step = self._flags[0] > 0
            if self._skip_step:
                for parameter in model.parameters():
                    parameter.grad = None  # optimizers pass over parameters without a gradient

    def record(self, loss: torch.Tensor, items: torch.Tensor | int | None = None) -> None:
        """The micro-batch's loss, for the logged means and the step's non-finite check (no host
        sync: kept on the device until the optimizer step ends). With `items` (the tokens,
        nodes, ... the loss is a mean over), the logged means weigh each micro-batch by them:
        the loss over every item of the window, whatever the launch splits them into."""
        self._window_losses.append(loss.detach())
        self._window_items.append(items)
        self._recorded = True

    def _after_micro_batch(self) -> bool:
        """Bookkeeping after the recipe's body for one micro-batch; True when the run is done."""
        self.log.flops.pause()
        if not self._recorded:
            raise RuntimeError("TrainLoop: call loop.record(loss) once for every batch")
        self._recorded = False
        micro_step_samples = self.plan.per_device_batch_size * self.plan.num_processes
        self.progress.samples_in_epoch += micro_step_samples
        if self.balanced is not None:
            costs = self.balanced.rank_costs[
                self.progress.samples_in_epoch // micro_step_samples - 1
            ]
            self._window_costs = costs if self._window_costs is None else self._window_costs + costs
        if not self.accelerator.sync_gradients:
            return False  # mid-accumulation: no optimizer step happened
        self.log.flops.step_done()
        if self._window_costs is not None:
            self._imbalances.append(imbalance(self._window_costs))
            self._window_costs = None
        if self.sync_timer is not None:
            self.sync_timer.take_step()
        skip_mode = self.on_nonfinite is OnNonFinite.skip and self.accelerator.scaler is None
        if skip_mode and self._flags is None:
            raise RuntimeError(
                "TrainLoop: --on-nonfinite skip needs loop.clip_gradients(model) between "
                "accelerator.backward(loss) and optimizer.step()"
            )
        nonfinite, stop_signals = self._flags or self._reduce_flags()
        skipped, self._flags, self._skip_step = self._skip_step, None, False
        lr = self.scheduler.get_last_lr()[0]  # the LR this step used: logged as its LR
        self.scheduler.step()
        self.progress.step += 1
        fp16 = self.accelerator.scaler is not None
        if fp16 and self.accelerator.optimizer_step_was_skipped:
            self.progress.skipped_steps += 1  # inf/NaN gradients: the scaler halved its scale
            skipped = self.on_nonfinite is OnNonFinite.skip
        losses, self._window_losses = self._window_losses, []
        items, self._window_items = self._window_items, []
        if skipped:
            self._skipped_nonfinite()
        elif nonfinite:
            self._diverged(nonfinite_losses(self.accelerator, losses))
        else:
            for loss, count in zip(losses, items, strict=True):
                self.log.add_loss(loss, count)
            self.ema.update()  # a step taken: not skipped (nor diverged, which stopped above)
        logged = self.log.step(self.progress.step, lr, self._grad_norm)
        self._grad_norm = None
        if logged is not None and fp16:
            self.accelerator.log(
                {"train/skipped_steps": self.progress.skipped_steps}, step=self.step
            )
        if logged is not None:
            self._require_finite(logged)  # every process sees the same reduced value
            self._log_balance()
        if stop_signals and not self.done:
            self._preempted()
        save_every = self.policy.saves.save_every
        if save_every and self.progress.step % save_every == 0 and not self.done:
            self.save()  # the final save comes from finish()
        return self.done

    def _log_balance(self) -> None:
        """On a logging step: the imbalance of the steps since the last (mean and max over
        steps) and, when timed, the mean all-reduce wait per step of the process that waited
        least (the communication) and most (plus waiting for the slowest)."""
        record = {}
        if self._imbalances:
            record["train/rank_imbalance"] = float(np.mean(self._imbalances))
            record["train/rank_imbalance_max"] = max(self._imbalances)
            self._imbalances = []
        if self.sync_timer is not None and self.sync_timer.attached:
            mine = torch.tensor([self.sync_timer.take_mean_ms()], device=self.accelerator.device)
            waits = self.accelerator.gather(mine).tolist()
            record |= {"train/sync_wait_ms_min": min(waits), "train/sync_wait_ms_max": max(waits)}
        if record:
            self.accelerator.log(record, step=self.step)

    def _skipped_nonfinite(self) -> None:
        """Count and report a step that every process skipped (its losses are not logged)."""
        self.progress.nonfinite_skipped += 1
        self.accelerator.log(
            {"train/nonfinite_skipped": self.progress.nonfinite_skipped}, step=self.step
        )
        say(
            self.accelerator,
            f"optimizer step {self.step}: non-finite loss or gradients on some process; every "
            f"process skipped this step ({self.progress.nonfinite_skipped} skipped so far)",
        )

    def _preempted(self) -> None:
        """Save the step every process just finished, then leave with Preempted."""
        path = self.save()
        self.stop_signals.release()
        self.log.close()
        self.accelerator.end_training()
        signal = self.stop_signals.received
        received = signal.name if signal else "A stop signal (elsewhere)"
        raise Preempted(
            f"{received} arrived during optimizer step {self.step}; every process finished it "
            f"and saved {path}. Exit code 75 asks the scheduler to requeue the job; it resumes "
            "from there: a SLURM requeue by itself, any other relaunch with --resume latest"
        )

    # ----------------------------------------------------------------------- around the loop

    def eval_due(self) -> bool:
        """Call after `loop.record(loss)`: whether the optimizer step this micro-batch ended is
        one to evaluate at (every `eval_every` steps from the run's start, so a resumed run
        evaluates at the same steps; not at an epoch's or the run's last: `end_epoch` does).
        It does the step's bookkeeping first, so the evaluation sees the step counted, logged,
        checked and saved."""
        every = self.policy.saves.eval_every
        if not every or not self.accelerator.sync_gradients or self._booked is not None:
            return False
        self._booked = self._after_micro_batch()
        micro_step_samples = self.plan.per_device_batch_size * self.plan.num_processes
        epoch_ends = self.progress.samples_in_epoch // micro_step_samples >= len(self.loader)
        return self.step % every == 0 and not self.done and not epoch_ends

    def log_eval(
        self, eval_metrics: dict[str, float], model: torch.nn.Module | None = None
    ) -> dict[str, float]:
        """Log an evaluation at this optimizer step (`eval_due`), as `eval/NAME` at the step and
        printed once, checked as `end_epoch` checks its metrics (reduced across processes by
        the recipe; no name the loop owns; finite). The epoch's training-loss mean goes on.
        With a `monitor`, pass the model: this evaluation may be the best model, and counts
        towards `patience` (then evaluations, not epochs: a run by iterations stops early too)."""
        check_eval_metrics(eval_metrics, self._epoch_number, self.step, self.run.last_saved)
        self.ema.require_scored(eval_metrics)
        logged = self.log.log_eval(self.step, eval_metrics)
        if self.stopping.monitor and model is not None:
            self._track_best(model, eval_metrics)
            if self.progress.stopped and self._booked is not None:
                self._booked = True  # the step's bookkeeping is done: the epoch ends here
        return logged

    def end_epoch(
        self, eval_metrics: dict[str, float], model: torch.nn.Module | None = None
    ) -> dict[str, float]:
        """Log the mean training loss since the last call and `eval_metrics` (reduced across
        processes by the recipe; with --ema-decay, of `loop.ema.applied()`); print them once.
        They become the export's metrics. With a `monitor`, pass the model: its best epoch is
        kept, and `patience` may stop the run."""
        check_eval_metrics(eval_metrics, self._epoch_number, self.step, self.run.last_saved)
        self.ema.require_scored(eval_metrics)  # before they are logged
        again = self._finished_before_epoch
        self.metrics = self.log.end_epoch(self._epoch_number, self.step, eval_metrics, again=again)
        if "train_loss" in self.metrics:  # none when nothing was trained (after a resume)
            self._require_finite(self.metrics["train_loss"])
        # not again for a finished run evaluated once more (its last epoch counted before its
        # save), nor after a step evaluation stopped the run (it counted that one)
        if self.stopping.monitor and not again and not self.progress.stopped:
            self._track_best(model, self.metrics)
        return self.metrics

    def _restore_loss_sums(self) -> None:
        """Continue the logged loss means where the checkpoint left them (an older checkpoint's:
        over the steps since the resume, marked, and said once)."""
        self.log.restore(self.progress.loss_sums)
        self.log.flops.restore(self.progress.flops_per_step)  # counted by the run's first launch
        if self.progress.loss_sums is None:
            say(
                self.accelerator,
                f"warning: {self.run.last_saved} stores no running loss sums (an older "
                "checkpoint): the first train/loss and train_loss logged after the resume cover "
                "only the steps since it, marked train/loss_partial and train_loss_partial",
            )

    def _track_best(self, model: torch.nn.Module | None, metrics: dict[str, float]) -> None:
        """Export the model when the monitored metric improved; count the evaluations it did
        not."""
        monitor = self.stopping.monitor
        if model is None or monitor not in metrics:
            raise TypeError(f"TrainLoop: end_epoch/log_eval need the model, a '{monitor}' metric")
        # the main process's value decides for all: no process can stop alone
        value = float(broadcast_object_list([metrics[monitor]])[0])
        epoch, step = self._epoch_number, self.step
        best, stop = self.stopping.judge(self.progress, value, metrics, epoch, step)
        if best:
            self.run.export(model, self.run.output_dir / BEST_DIR, self.progress.best_metrics)
        if stop:
            say(self.accelerator, self.stopping.stopped(self.progress, self.policy.saves))

    def save(self) -> Path:
        """Save resumable state at the current step (collective: every process calls it), only
        after the step's non-finite check, so the last checkpoint is always one to resume from."""
        self._count_time()  # the checkpoint records the training time up to here
        self.progress.loss_sums = self.log.state()
        self.progress.flops_per_step = self.log.flops.per_step
        consumed = self.progress.batches_to_skip(self.plan)  # this epoch's, on this process
        return self.run.save(self.policy.saves.keep_last, fetched_ahead(self.loader, consumed))

    def finish(self, model: torch.nn.Module) -> dict[str, float]:
        """Save the final resumable state, export `model` (with --ema-decay, its EMA) with the
        last metrics, close trackers; return the metrics the export records. Every process calls
        it (gathering shards is collective). A resumed run that had finished and exported
        (`Run.finished_export`) saves and exports nothing: it returns its export's metrics."""
        self.log.close()
        self.stop_signals.release()
        if self.run.finished_export is not None:
            self.metrics = read_export_metadata(self.run.finished_export)["metrics"]
            self.accelerator.end_training()
            return self.metrics
        # what the whole run counted, in every export: the best epoch's included
        totals: dict[str, float] = {"train_seconds": self.train_seconds}
        if self.accelerator.scaler is not None:
            totals["skipped_steps"] = self.progress.skipped_steps
        if self.on_nonfinite is OnNonFinite.skip:
            totals["nonfinite_skipped"] = self.progress.nonfinite_skipped
        self.metrics |= totals
        if not all_finite(self.accelerator, model):
            self._diverged("the weights contain NaN or infinite values")
        self.save()
        if self.stopping.monitor and self.progress.best_metrics:
            self.metrics = {**self.progress.best_metrics, **totals}
            path = self.run.export_best(self.metrics)
        else:
            path = self.run.export(model, self.run.output_dir / "model", self.metrics)
        say(self.accelerator, f"exported {path}")
        self.accelerator.end_training()
        return self.metrics

    def config(self) -> dict[str, Any]:
        """Every setting of this run as it reads back from JSON (recorded with checkpoints)."""
        return self.run.config.as_json()

    def _reduce_flags(self, grad_norm: torch.Tensor | None = None) -> tuple[int, int]:
        received = self.stop_signals.received is not None
        return reduce_flags(self.accelerator, self._window_losses, received, grad_norm)

    def _require_finite(self, loss: float) -> None:
        """Stop on a non-finite (reduced, so identical on every process) training loss."""
        if not math.isfinite(loss):
            self._diverged(f"the training loss is {loss}")

    def _diverged(self, what: str) -> None:
        raise diverged(what, self.progress.step, self.run.last_saved)
