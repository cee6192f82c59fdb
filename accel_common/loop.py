"""The training loop's bookkeeping, written once: epochs, resume, step counting, saves, export.

A recipe's loop keeps in view what is about its workload and hands the rest to a `TrainLoop`:

    loop = TrainLoop(accelerator, plan, train_loader, schedule, recipe="mine", config=config,
                     output_dir=output_dir)
    for epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        loop.end_epoch(evaluate(model, test_loader))
    return loop.finish(model)

Everything happens in that order, in the recipe's own loop; `TrainLoop` has no callbacks.
`batches()` does its bookkeeping when the recipe asks for the next batch, i.e. after the
optimizer step of the previous one:

- every micro-batch: count the samples seen in this epoch (the resume position);
- after a micro-batch that ends an accumulation window (an optimizer step happened): step the
  LR scheduler once, count the optimizer step, log loss / LR / grad norm / samples/s every
  `log_every` steps, save resumable state every `save_every` steps;
- when the run's optimizer steps are done, stop in the middle of the epoch, so the final
  checkpoint records exactly where it ended; accumulation windows run across epoch ends.

With `monitor="val_mae"` (lower is better), `end_epoch(metrics, model)` keeps an export of the
model at its best epoch (`OUTPUT/best`), and `finish` exports that one; with `patience` N, the
run stops after N epochs without improvement (with `min_epochs` M, not before epoch M + 1: the
count may reach N earlier, the stop waits). Both decide from the value the main process holds,
broadcast to all, so every process stops at the same epoch (none waits alone in a collective);
a resumed run restores the best value and the count.

`epochs()` sets the epoch on the loader and on a dataset that has `set_epoch` (so samples that
depend on the epoch are the same on 1 or N processes), and skips what a resumed run already
trained on. A run resumed after it had finished yields no epoch and `finish` leaves its export
as it was (it says so); only if that export is missing (a crash between the final save and the
export) does it yield one epoch with no batches, so the recipe's evaluation runs again and the
export carries its metrics. An epoch in which nothing was trained reports no training loss.
Nothing non-finite reaches a JSON file: a NaN evaluation metric stops the run like a NaN loss.

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

import json
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from accel_common.balance import find_balanced_sampler, imbalance
from accel_common.batching import BatchPlan
from accel_common.checkpoint import (
    TrainProgress,
    checkpoint_step,
    describe_differences,
    list_checkpoints,
    load_checkpoint,
    remove_unfinished_saves,
    resolve_resume,
    save_checkpoint,
)
from accel_common.console import format_metrics, print_banner, say
from accel_common.data.files import folder_fingerprint
from accel_common.errors import CheckpointError, ConfigError, NonFiniteError, Preempted
from accel_common.export import (
    META_FILE,
    MODEL_FILE,
    export_model,
    read_export_metadata,
    write_export,
)
from accel_common.lr import LRSchedule
from accel_common.sync_wait import SyncWaitTimer, timing_requested
from accel_common.tracking import METRICS_FILE, StepLogger, start_tracking

# what a resume never reports as changed: how this launch was asked to start
LAUNCH_SETTINGS = frozenset({"resume", "overwrite", "overwrite_later"})
BEST_DIR = "best"  # the best epoch's export, with a `monitor`
# what a scheduler sends before it ends a job: SLURM (--signal=USR1@120, then SIGTERM at the end),
# Kubernetes and torchrun's agent (SIGTERM)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class OnNonFinite(str, Enum):
    stop = "stop"
    skip = "skip"


def launcher_restart() -> str | None:
    """How this process was restarted, or None for a first start: torch elastic (torchrun,
    `accelerate launch --max_restarts N`) counts its restarts of the worker group in
    TORCHELASTIC_RESTART_COUNT; SLURM counts requeues of the job in SLURM_RESTART_COUNT."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if count not in ("", "0"):
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        return f"restart {count} of {limit} by the launcher"
    count = os.environ.get("SLURM_RESTART_COUNT", "0")
    if count not in ("", "0"):
        return f"SLURM requeue {count}"
    return None


class TrainLoop:
    """One training run's bookkeeping; see the module docstring for the loop it serves.

    Creating it prints the plan, restores `resume` ('latest', a checkpoint folder, or None) into
    the prepared objects (so create it after `accelerator.prepare`), and starts the trackers
    (only after a successful resume, so a bad `resume` leaves the output folder as it was).
    Every process must create it and run the same loop: saves and logging are collective.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        plan: BatchPlan,
        loader: DataLoader,
        schedule: LRSchedule,
        *,
        recipe: str,
        config: dict[str, Any],
        output_dir: Path,
        adjustable: frozenset[str] = frozenset(),
        derived: frozenset[str] = frozenset(),
        resume: str | None = None,
        overwrite: bool = False,
        overwrite_later: bool = False,
        data_dir: Path | None = None,
        log_every: int = 50,
        save_every: int = 0,
        keep_last: int = 2,
        clip_grad: float = 0.0,
        tracker_project: str | None = None,
        tracker_run_name: str | None = None,
        on_nonfinite: OnNonFinite | str = OnNonFinite.stop,
        monitor: str | None = None,
        patience: int = 0,
        min_epochs: int = 0,
        min_delta: float = 0.0,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        if patience and not monitor:
            raise ConfigError("TrainLoop: patience needs a metric to monitor")
        self.monitor, self.patience, self.min_epochs = monitor, patience, min_epochs
        self.min_delta = min_delta
        self.accelerator, self.plan, self.loader = accelerator, plan, loader
        self.scheduler, self.total_steps = schedule.scheduler, schedule.total_steps
        self.recipe, self.config, self.output_dir = recipe, config, Path(output_dir)
        self.save_every, self.keep_last, self.clip_grad = save_every, keep_last, clip_grad
        self.on_nonfinite = OnNonFinite(on_nonfinite)
        if self.on_nonfinite is OnNonFinite.skip and (
            accelerator.distributed_type == DistributedType.DEEPSPEED
        ):
            raise ConfigError(
                "--on-nonfinite skip does not work under DeepSpeed, whose engine takes the "
                "optimizer step itself; use --on-nonfinite stop (fp16 runs: DeepSpeed's loss "
                "scaler already skips overflowing steps)"
            )
        self.metrics: dict[str, float] = {}
        self.last_saved: Path | None = None
        self.finished_export: Path | None = None  # a finished run's export, left as it is
        self._timing_since: float | None = None  # inside batches(): training time runs
        self._epoch_number = 0
        self._finished_before_epoch = False
        self._grad_norm: torch.Tensor | None = None
        self._recorded = False
        self._window_losses: list[torch.Tensor] = []  # this optimizer step's, logged once it ends
        self._flags: tuple[int, int] | None = None  # reduced early by clip_gradients (skip mode)
        self._skip_step = False
        self._stop_signal: signal.Signals | None = None
        self._previous_handlers: dict[signal.Signals, Any] = {}
        # a loader balanced by cost knows every process's cost per micro-step: logged as the
        # step's imbalance, with no collective (balance.py)
        self.balanced = find_balanced_sampler(loader) if plan.num_processes > 1 else None
        self._window_costs: np.ndarray | None = None
        self._imbalances: list[float] = []
        # the benchmark's timing of the gradient all-reduce, attached to the model in
        # clip_gradients (Accelerate does not keep the DDP wrapper it prepared)
        timed = timing_requested() and accelerator.num_processes > 1
        self.sync_timer = SyncWaitTimer() if timed else None
        self.adjustable, self.derived, self.data_dir = adjustable, derived, data_dir
        self.defaults = defaults or {}  # the settings' declared defaults (checkpoint.py)
        # the data's content fingerprint: read by the main process (once: its per-file digests
        # are cached), the same for all
        fingerprint = None
        if accelerator.is_main_process and data_dir is not None and Path(data_dir).exists():
            fingerprint = folder_fingerprint(data_dir, cache_dir=data_hash_cache())
        fingerprint = broadcast_object_list([fingerprint])[0]
        self.identity = run_identity(recipe, config, plan, None, adjustable, fingerprint)

        print_banner(
            accelerator,
            recipe=recipe,
            plan=plan,
            lr_line=schedule.description,
            total_steps=self.total_steps,
        )
        self.progress = self._resume(resume, overwrite, overwrite_later)
        self._catch_stop_signals()
        if self.finished_export is None:  # a finished run logs nothing more
            start_tracking(
                accelerator,
                project=tracker_project or f"accel-recipes-{recipe}",
                run_name=tracker_run_name,
                output_dir=self.output_dir,
                config={**config, **plan.as_dict()},
            )
        self.log = StepLogger(
            accelerator,
            total_steps=self.total_steps,
            initial_step=self.progress.step,
            log_every=log_every,
            global_batch_size=plan.global_batch_size,
            desc=recipe,
        )

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
        """A CPU generator for this evaluation's random draws (sampling noise, random baselines):
        seeded by the run's --seed, the optimizer step being evaluated and, unless
        `per_process=False`, the process index. What an evaluation draws then depends only on
        the step it scores, never on how many evaluations ran before it in this process, so a
        resumed run exports the metrics of the uninterrupted one. The global RNG (dropout,
        restored by a resume) is left alone."""
        index = self.accelerator.process_index if per_process else 0
        return evaluation_generator(int(self.config.get("seed", 0)), self.step, index)

    @property
    def done(self) -> bool:
        """Whether the run has taken all its optimizer steps, or stopped early."""
        return self.progress.step >= self.total_steps or self.progress.stopped

    # ----------------------------------------------------------------------- the loop itself

    def epochs(self) -> Iterator[int]:
        """Epoch numbers (from 1) until the run's optimizer steps are done: at least one, but
        none for a resumed run that had finished and exported (`finished_export`)."""
        if self.finished_export is not None:
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
        if self.progress.samples_in_epoch:  # resumed mid-epoch: skip what was already trained on
            skip = self.progress.batches_to_skip(self.plan)
            batches = self.accelerator.skip_first_batches(self.loader, skip)
        self._timing_since = time.perf_counter()
        try:
            for batch in batches:
                yield batch
                if self._after_micro_batch():
                    break  # the epoch stays unfinished: the final checkpoint records where
            else:
                self.progress.epoch, self.progress.samples_in_epoch = epoch + 1, 0
        finally:
            self._count_time()
            self._timing_since = None

    def clip_gradients(self, model: torch.nn.Module) -> None:
        """Call between `backward` and `optimizer.step()`: on the micro-batch that ends an
        accumulation window, clip the gradient norm to `clip_grad` (if set) and keep the norm
        for logging (measured only on logging steps when not clipping). Elsewhere a no-op:
        clipping a partial sum of gradients would change the update.

        With `on_nonfinite="skip"` it also decides, on every process alike, whether this step is
        taken: a non-finite gradient norm anywhere (reduced with the step's flags) drops every
        gradient, so `optimizer.step()` leaves the weights and the optimizer state as they are.
        Under fp16 the loss scaler makes that decision itself."""
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
            self._flags = self._reduce_flags(grad_norm=self._grad_norm)
            self._skip_step = self._flags[0] > 0
            if self._skip_step:
                for parameter in model.parameters():
                    parameter.grad = None  # optimizers pass over parameters without a gradient

    def record(self, loss: torch.Tensor) -> None:
        """The micro-batch's loss, for the logged means and the step's non-finite check (no host
        sync: kept on the device until the optimizer step ends)."""
        self._window_losses.append(loss.detach())
        self._recorded = True

    def _after_micro_batch(self) -> bool:
        """Bookkeeping after the recipe's body for one micro-batch; True when the run is done."""
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
        self.scheduler.step()
        self.progress.step += 1
        fp16 = self.accelerator.scaler is not None
        if fp16 and self.accelerator.optimizer_step_was_skipped:
            self.progress.skipped_steps += 1  # inf/NaN gradients: the scaler halved its scale
            skipped = self.on_nonfinite is OnNonFinite.skip
        losses, self._window_losses = self._window_losses, []
        if skipped:
            self._skipped_nonfinite()
        elif nonfinite:
            self._nonfinite_loss(losses)
        else:
            for loss in losses:
                self.log.add_loss(loss)
        logged = self.log.step(self.progress.step, self.scheduler, self._grad_norm)
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
        if self.save_every and self.progress.step % self.save_every == 0 and not self.done:
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
            record["train/sync_wait_ms_min"], record["train/sync_wait_ms_max"] = (
                min(waits),
                max(waits),
            )
        if record:
            self.accelerator.log(record, step=self.step)

    def _reduce_flags(self, grad_norm: torch.Tensor | None = None) -> tuple[int, int]:
        """(processes with a non-finite loss or gradient norm in this optimizer step, processes
        that received a stop signal): one all-reduce, the same answer on every process."""
        device = self.accelerator.device
        local = torch.zeros(2, device=device)
        values = [loss.float().reshape(-1) for loss in self._window_losses]
        if grad_norm is not None:
            values.append(grad_norm.float().reshape(-1).to(device))
        if values:
            local[0] = (~torch.isfinite(torch.cat(values))).any()
        local[1] = self._stop_signal is not None
        nonfinite, stop_signals = self.accelerator.reduce(local, reduction="sum").tolist()
        return int(nonfinite), int(stop_signals)

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

    def _nonfinite_loss(self, losses: list[torch.Tensor]) -> None:
        """Stop every process at this step, naming the processes whose loss was non-finite."""
        local = torch.cat([loss.float().reshape(-1) for loss in losses])
        bad = ~torch.isfinite(local)
        value = local[bad][0].item() if bad.any() else float("nan")
        flags = self.accelerator.gather(bad.any().reshape(1).float()).tolist()
        where = ", ".join(str(rank) for rank, flag in enumerate(flags) if flag) or "?"
        self._diverged(f"the training loss went non-finite ({value}) on process {where}")

    def _catch_stop_signals(self) -> None:
        """Turn SIGTERM/SIGUSR1 into a save at the end of the optimizer step in progress. The
        signal often arrives more than once (from the scheduler and again from the launcher);
        every copy after the first is ignored."""
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self._stop_signal = self._stop_signal or signal.Signals(signum)

        for sig in STOP_SIGNALS:
            self._previous_handlers[sig] = signal.signal(sig, on_signal)

    def _release_stop_signals(self) -> None:
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def _preempted(self) -> None:
        """Save the step every process just finished, then leave with Preempted."""
        path = self.save()
        self._release_stop_signals()
        self.log.close()
        self.accelerator.end_training()
        received = self._stop_signal.name if self._stop_signal else "A stop signal (elsewhere)"
        raise Preempted(
            f"{received} arrived during optimizer step {self.step}; every process finished it "
            f"and saved {path}. Exit code 75 asks the scheduler to requeue the job; it resumes "
            "from there: a SLURM requeue by itself, any other relaunch with --resume latest"
        )

    # ----------------------------------------------------------------------- around the loop

    def end_epoch(
        self, eval_metrics: dict[str, float], model: torch.nn.Module | None = None
    ) -> dict[str, float]:
        """Log the mean training loss since the last call and `eval_metrics` (reduced across
        processes by the recipe); print them once. They become the export's metrics. With a
        `monitor`, pass the model: its best epoch is kept, and `patience` may stop the run."""
        self._require_finite_metrics(eval_metrics)  # before they are logged
        if self.log.epoch_loss.count == 0:  # resumed at the epoch's end: nothing trained in it
            self.metrics = self._end_untrained_epoch(eval_metrics)
        else:
            self.metrics = self.log.end_epoch(self._epoch_number, self.step, eval_metrics)
            self._require_finite(self.metrics["train_loss"])
        # not again for a finished run evaluated once more: its last epoch counted before its save
        if self.monitor and not self._finished_before_epoch:
            self._track_best(model)
        return self.metrics

    def _end_untrained_epoch(self, eval_metrics: dict[str, float]) -> dict[str, float]:
        """Log and print an epoch's evaluation without a training loss (there is none: the
        logger's mean over no steps would be NaN)."""
        metrics = dict(eval_metrics)
        self.accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=self.step)
        if self.accelerator.is_main_process:
            self.log.bar.write(f"epoch {self._epoch_number}: {format_metrics(metrics)}")
        return metrics

    def _require_finite_metrics(self, metrics: dict[str, float]) -> None:
        """Stop on a NaN or infinite evaluation metric (the same on every process: the recipes
        compute them from gathered values): the metrics log and the export are JSON, which has
        no such numbers."""
        bad = [(k, v) for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
        if not bad:
            return
        named = ", ".join(f"{key} is {value}" for key, value in bad)
        where = (
            f"the last good checkpoint is {self.last_saved}"
            if self.last_saved
            else "no checkpoint was saved before it"
        )
        raise NonFiniteError(
            f"the evaluation metric {named} at epoch {self._epoch_number} (optimizer step "
            f"{self.step}); a metrics log or export cannot record it, so the run stopped "
            f"without saving or exporting ({where}). Check the evaluation (a constant target "
            "or score, an empty split) and the weights"
        )

    def _track_best(self, model: torch.nn.Module | None) -> None:
        """Export the model when the monitored metric improved; count the epochs it did not."""
        if model is None or self.monitor not in self.metrics:
            raise TypeError(f"TrainLoop: end_epoch needs the model and a '{self.monitor}' metric")
        # the main process's value decides for all: no process can stop alone
        value = float(broadcast_object_list([self.metrics[self.monitor]])[0])
        progress = self.progress
        # any lower value is the best model; only one lower by more than min_delta resets the
        # patience count (as the cricket original's trainer: a tiny gain does not keep it going)
        significant = progress.best is None or value < progress.best - self.min_delta
        if progress.best is None or value < progress.best:
            progress.best = value
            progress.best_metrics = {**self.metrics, "best_epoch": self._epoch_number}
            self._export(model, self.output_dir / BEST_DIR, progress.best_metrics)
        if significant:
            progress.bad_epochs = 0
            return
        progress.bad_epochs += 1
        patient = progress.bad_epochs < self.patience or self._epoch_number <= self.min_epochs
        if self.patience and not patient:
            progress.stopped = True
            say(
                self.accelerator,
                f"early stopping: {self.monitor} has not improved for {self.patience} epochs "
                f"(best {progress.best:.4g} at epoch {progress.best_metrics['best_epoch']}); "
                "the export is that epoch's model",
            )

    def save(self) -> Path:
        """Save resumable state at the current step (collective: every process calls it).

        Called only after the step's non-finite check, so the last checkpoint is always one to
        resume from."""
        self._count_time()  # the checkpoint records the training time up to here
        self.last_saved = save_checkpoint(
            self.accelerator,
            self.output_dir,
            self.progress,
            plan=self.plan,
            keep_last=self.keep_last,
            run={"id": self.run_id, "identity": self.identity, "settings": self.settings()},
        )
        return self.last_saved

    def finish(self, model: torch.nn.Module) -> dict[str, float]:
        """Save the final resumable state, export `model` with the last metrics, close trackers.

        Returns the metrics the export records. Every process calls it (gathering shards is
        collective). A resumed run that had finished and exported (`finished_export`) saves and
        exports nothing: it returns the metrics its export records.
        """
        self.log.close()
        self._release_stop_signals()
        if self.finished_export is not None:
            self.metrics = read_export_metadata(self.finished_export)["metrics"]
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
        if self.monitor and self.progress.best_metrics:
            self.metrics = {**self.progress.best_metrics, **totals}
            path = self._export_best()
        else:
            path = self._export(model, self.output_dir / "model", self.metrics)
        say(self.accelerator, f"exported {path}")
        self.accelerator.end_training()
        return self.metrics

    def _export(self, model: torch.nn.Module, folder: Path, metrics: dict[str, float]) -> Path:
        return export_model(
            self.accelerator,
            model,
            folder,
            recipe=self.recipe,
            config=self.config,
            plan=self.plan,
            step=self.progress.step,
            metrics=metrics,
        )

    def _export_best(self) -> Path:
        """The best epoch's export becomes the run's export, with the run's final metrics."""
        best, final = self.output_dir / BEST_DIR, self.output_dir / "model"
        if self.accelerator.is_main_process:
            metadata = read_export_metadata(best)
            metadata["metrics"] = self.metrics
            write_export(load_file(str(best / MODEL_FILE)), final, metadata)
        self.accelerator.wait_for_everyone()
        return final / MODEL_FILE

    def settings(self) -> dict[str, Any]:
        """Every setting of this run as it reads back from JSON (recorded with checkpoints)."""
        return json.loads(json.dumps(self.config, default=str))

    def _resume(self, resume: str | None, overwrite: bool, overwrite_later: bool) -> TrainProgress:
        """Restore `resume`, or start fresh in an output folder that holds no other run."""
        if overwrite and resume is not None:
            raise ConfigError("--overwrite starts a new run; it cannot go with --resume")
        if overwrite_later and resume is None:
            raise ConfigError(
                "--overwrite-later goes with --resume CHECKPOINT (an older step of the run); "
                "without --resume there is nothing to train on from"
            )
        remove_unfinished_saves(self.accelerator, self.output_dir)
        restart = launcher_restart()
        if restart and (resume is None or list_checkpoints(self.output_dir)):
            # the first start claimed the folder (and moved an old run aside on --overwrite)
            say(self.accelerator, f"{restart}: continuing from the newest complete checkpoint")
            resume, overwrite = "latest", False
        path = resolve_resume(resume, self.output_dir)
        if path is None:
            self._claim_output_dir(resume, overwrite)
            self.run_id = broadcast_object_list([uuid.uuid4().hex[:12]])[0]
            return TrainProgress()
        progress, run = load_checkpoint(
            self.accelerator,
            path,
            self.plan,
            identity=self.identity,
            defaults=self.defaults,
            adjustable=self.adjustable,
            total_steps=self.total_steps,
            data_dir=self.data_dir,
            derived=self.derived,
        )
        self._make_way_for(path, progress.step, resume, overwrite_later)
        noted = self.adjustable - LAUNCH_SETTINGS
        saved = run.get("settings", run.get("identity", {}))
        changed = describe_differences(
            {k: saved[k] for k in noted if k in saved},
            {k: v for k, v in self.settings().items() if k in noted and k in saved},
        )
        if changed:
            say(self.accelerator, f"resuming with changed settings: {changed}")
        self.run_id = run.get("id") or broadcast_object_list([uuid.uuid4().hex[:12]])[0]
        self.last_saved = path
        say(
            self.accelerator,
            f"resumed from {path}: step {progress.step}, epoch {progress.epoch}, "
            f"{progress.samples_in_epoch} samples into it",
        )
        self.finished_export = self._export_of_finished_run(progress)
        if self.finished_export is not None:
            say(
                self.accelerator,
                f"the run in {self.output_dir} already finished at step {progress.step}; its "
                f"export in {self.finished_export} is unchanged (to train on, resume with a "
                "larger --epochs or --max-steps)",
            )
        return progress

    def _make_way_for(
        self, path: Path, step: int, resume: str | None, overwrite_later: bool
    ) -> None:
        """Training on from `step` would overwrite what the run saved after it (its checkpoints
        of later steps, an export of a later step) and prune its own new checkpoints in favour
        of those: refused, unless `overwrite_later`, which moves them aside (nothing is
        deleted), so the folder holds one history again. The main process looks, for all."""
        found_later: list[Any] = [[], {}]
        if self.accelerator.is_main_process:
            found_later = [
                [str(p) for p in list_checkpoints(self.output_dir) if checkpoint_step(p) > step],
                {
                    str(folder): exported
                    for folder in (self.output_dir / "model", self.output_dir / BEST_DIR)
                    if (exported := export_step(folder)) is not None and exported > step
                },
            ]
        names, steps = broadcast_object_list(found_later)
        later = [Path(name) for name in names]
        exports = {Path(folder): exported for folder, exported in steps.items()}
        if not later and not exports:
            return
        found = ", ".join(
            [p.name for p in later]
            + [f"the export of step {n} ({folder})" for folder, n in exports.items()]
        )
        if not overwrite_later:
            raise CheckpointError(
                f"--resume {resume}: {self.output_dir} holds later results of this run "
                f"({found}); training on from step {step} would overwrite them. Continue from "
                "the newest with --resume latest, or pass --overwrite-later to move them aside "
                f"(to NAME.replaced-<time>) and train on from {path.name}"
            )
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = [*later, *exports]
        if self.accelerator.is_main_process:
            for old in moved:
                old.rename(old.with_name(f"{old.name}.replaced-{stamp}"))
        self.accelerator.wait_for_everyone()
        say(
            self.accelerator,
            f"--overwrite-later: moved aside {found} (to NAME.replaced-{stamp}); training on "
            f"from step {step}",
        )

    def _export_of_finished_run(self, progress: TrainProgress) -> Path | None:
        """The export of a run that had finished when it was saved, if it is the one `finish`
        wrote: of its last step, or with a `monitor` the best epoch's with its final metrics.
        One missing or unreadable is exported again. The main process decides for all."""
        found = None
        finished = progress.step >= self.total_steps or progress.stopped
        folder = self.output_dir / "model"
        if finished and self.accelerator.is_main_process and (folder / MODEL_FILE).is_file():
            try:
                metadata = read_export_metadata(folder) if (folder / META_FILE).is_file() else {}
            except CheckpointError:
                metadata = {}
            if self.monitor and progress.best_metrics:
                final = {**progress.best_metrics, "train_seconds": progress.train_seconds}
                written = metadata.get("metrics") == final
            else:
                written = metadata.get("step") == progress.step
            found = str(folder) if written else None
        found = broadcast_object_list([found])[0]
        return Path(found) if found else None

    def _claim_output_dir(self, resume: str | None, overwrite: bool) -> None:
        """A new run refuses a folder that holds another run's results (its checkpoints would be
        mistaken for this run's by --resume latest, and its logs would interleave), unless
        --overwrite, which moves that folder aside: nothing is deleted."""
        earlier = [
            found
            for found in (
                *list_checkpoints(self.output_dir)[-1:],
                self.output_dir / "model",
                self.output_dir / "logs" / METRICS_FILE,
            )
            if found.exists()
        ]
        if resume == "latest":  # no checkpoint yet: this run starts over (logs continue)
            say(self.accelerator, f"--resume latest: no checkpoint in {self.output_dir}")
            return
        if not earlier:
            return
        if not overwrite:
            raise CheckpointError(
                f"--output-dir {self.output_dir} already holds another run ({earlier[0]}); "
                "continue it with --resume latest, write this run to another --output-dir, or "
                "pass --overwrite to move the old one aside"
            )
        aside = self.output_dir.with_name(
            f"{self.output_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        if self.accelerator.is_main_process:
            self.output_dir.rename(aside)
            self.output_dir.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        say(self.accelerator, f"--overwrite: moved the earlier run in {self.output_dir} to {aside}")

    def _require_finite(self, loss: float) -> None:
        """Stop on a non-finite (reduced, so identical on every process) training loss."""
        if not math.isfinite(loss):
            self._diverged(f"the training loss is {loss}")

    def _diverged(self, what: str) -> None:
        where = (
            f"The last good checkpoint is {self.last_saved}: resume from it with a lower --lr or "
            "a --clip-grad"
            if self.last_saved
            else "No checkpoint was saved before it: lower --lr or set --clip-grad"
        )
        raise NonFiniteError(
            f"{what} at optimizer step {self.progress.step}; stopped without saving or "
            f"exporting. {where}, pass --on-nonfinite skip to skip such steps, or check the data "
            "for NaN and infinite values"
        )


def run_identity(
    recipe: str,
    config: dict[str, Any],
    plan: BatchPlan,
    data_dir: Path | None,
    adjustable: frozenset[str] = frozenset(),
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """What makes a checkpoint this run's: every setting but the `adjustable` ones, the recipe,
    the global batch and the data's content fingerprint (`fingerprint`, or computed from
    `data_dir`, a folder or a file), as they read back from JSON."""
    identity = {k: v for k, v in config.items() if k not in adjustable}
    identity |= {"recipe": recipe, "global_batch_size": plan.global_batch_size}
    if fingerprint is None and data_dir is not None and Path(data_dir).exists():
        fingerprint = folder_fingerprint(data_dir)
    if fingerprint is not None:
        identity["data_fingerprint"] = fingerprint
    return json.loads(json.dumps(identity, default=str))


def export_step(folder: Path) -> int | None:
    """The optimizer step an export folder records, or None (none there, or unreadable)."""
    if not (folder / META_FILE).is_file():
        return None
    try:
        step = read_export_metadata(folder).get("step")
    except CheckpointError:
        return None
    return step if isinstance(step, int) else None


def data_hash_cache() -> Path:
    """Where data fingerprints keep their per-file digests: beside the prepared tables
    (accel_common.data.cache: HF_DATASETS_CACHE/accel-recipes, so HF_HOME moves both), found as
    `datasets` finds its cache, without importing it."""
    if os.environ.get("HF_DATASETS_CACHE"):
        root = Path(os.environ["HF_DATASETS_CACHE"])
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache"))
        root = Path(os.environ.get("HF_HOME", os.path.join(xdg, "huggingface"))) / "datasets"
    return root.expanduser() / "accel-recipes"


def evaluation_generator(seed: int, step: int, process_index: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, process index), each mixed in fully (numpy's
    SeedSequence): neighbouring steps or processes get unrelated streams."""
    state = np.random.SeedSequence([seed, step, process_index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


@torch.no_grad()
def all_finite(accelerator: Accelerator, model: torch.nn.Module) -> bool:
    """Whether every weight of `model` is finite on every process (collective)."""
    bad = torch.zeros((), device=accelerator.device)
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter  # FSDP2
        bad += (~torch.isfinite(local)).sum()
    return accelerator.reduce(bad, reduction="sum").item() == 0
