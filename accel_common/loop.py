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

`epochs()` sets the epoch on the loader and on a dataset that has `set_epoch` (so samples that
depend on the epoch are the same on 1 or N processes), and skips what a resumed run already
trained on. A run resumed after it had finished yields one epoch with no batches, so the
recipe's evaluation runs again and the export carries its metrics.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from accel_common.batching import BatchPlan
from accel_common.checkpoint import (
    TrainProgress,
    export_model,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from accel_common.console import print_banner, say
from accel_common.lr import LRSchedule
from accel_common.tracking import StepLogger, start_tracking


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
        resume: str | None = None,
        log_every: int = 50,
        save_every: int = 0,
        keep_last: int = 2,
        clip_grad: float = 0.0,
        tracker_project: str | None = None,
        tracker_run_name: str | None = None,
    ) -> None:
        self.accelerator, self.plan, self.loader = accelerator, plan, loader
        self.scheduler, self.total_steps = schedule.scheduler, schedule.total_steps
        self.recipe, self.config, self.output_dir = recipe, config, Path(output_dir)
        self.save_every, self.keep_last, self.clip_grad = save_every, keep_last, clip_grad
        self.metrics: dict[str, float] = {}
        self.train_seconds = 0.0
        self._epoch_number = 0
        self._grad_norm: torch.Tensor | None = None
        self._recorded = False

        print_banner(
            accelerator,
            recipe=recipe,
            plan=plan,
            lr_line=schedule.description,
            total_steps=self.total_steps,
        )
        self.progress = self._resume(resume)
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
    def done(self) -> bool:
        """Whether the run has taken all its optimizer steps."""
        return self.progress.step >= self.total_steps

    # ----------------------------------------------------------------------- the loop itself

    def epochs(self) -> Iterator[int]:
        """Epoch numbers (from 1) until the run's optimizer steps are done; at least one."""
        while True:
            before = (self.progress.step, self.progress.epoch)
            self._epoch_number = self.progress.epoch + 1
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
        started = time.perf_counter()
        try:
            for batch in batches:
                yield batch
                if self._after_micro_batch():
                    break  # the epoch stays unfinished: the final checkpoint records where
            else:
                self.progress.epoch, self.progress.samples_in_epoch = epoch + 1, 0
        finally:
            self.train_seconds += time.perf_counter() - started

    def clip_gradients(self, model: torch.nn.Module) -> None:
        """Call between `backward` and `optimizer.step()`: on the micro-batch that ends an
        accumulation window, clip the gradient norm to `clip_grad` (if set) and keep the norm
        for logging (measured only on logging steps when not clipping). Elsewhere a no-op:
        clipping a partial sum of gradients would change the update."""
        if not self.accelerator.sync_gradients:
            return
        if self.clip_grad > 0:
            self._grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.clip_grad)
        elif self.log.logs_at(self.progress.step + 1):
            self._grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), float("inf"))

    def record(self, loss: torch.Tensor) -> None:
        """The micro-batch's loss, for the logged means (no host sync: summed on the device)."""
        self.log.add_loss(loss)
        self._recorded = True

    def _after_micro_batch(self) -> bool:
        """Bookkeeping after the recipe's body for one micro-batch; True when the run is done."""
        if not self._recorded:
            raise RuntimeError("TrainLoop: call loop.record(loss) once for every batch")
        self._recorded = False
        self.progress.samples_in_epoch += self.plan.per_device_batch_size * self.plan.num_processes
        if not self.accelerator.sync_gradients:
            return False  # mid-accumulation: no optimizer step happened
        self.scheduler.step()
        self.progress.step += 1
        self.log.step(self.progress.step, self.scheduler, self._grad_norm)
        self._grad_norm = None
        if self.save_every and self.progress.step % self.save_every == 0 and not self.done:
            self.save()  # the final save comes from finish()
        return self.done

    # ----------------------------------------------------------------------- around the loop

    def end_epoch(self, eval_metrics: dict[str, float]) -> dict[str, float]:
        """Log the mean training loss since the last call and `eval_metrics` (reduced across
        processes by the recipe); print them once. They become the export's metrics."""
        self.metrics = self.log.end_epoch(self._epoch_number, self.progress.step, eval_metrics)
        return self.metrics

    def save(self) -> Path:
        """Save resumable state at the current step (collective: every process calls it)."""
        return save_checkpoint(
            self.accelerator,
            self.output_dir,
            self.progress,
            plan=self.plan,
            keep_last=self.keep_last,
        )

    def finish(self, model: torch.nn.Module) -> dict[str, float]:
        """Save the final resumable state, export `model` with the last metrics, close trackers.

        Returns the metrics the export records. Every process calls it (gathering shards is
        collective).
        """
        self.log.close()
        self.metrics["train_seconds"] = self.train_seconds
        self.save()
        path = export_model(
            self.accelerator,
            model,
            self.output_dir / "model",
            recipe=self.recipe,
            config=self.config,
            plan=self.plan,
            step=self.progress.step,
            metrics=self.metrics,
        )
        say(self.accelerator, f"exported {path}")
        self.accelerator.end_training()
        return self.metrics

    def _resume(self, resume: str | None) -> TrainProgress:
        path = resolve_resume(resume, self.output_dir)
        if path is None:
            if resume == "latest":
                say(self.accelerator, f"--resume latest: no checkpoint in {self.output_dir}")
            return TrainProgress()
        progress = load_checkpoint(self.accelerator, path, self.plan)
        say(
            self.accelerator,
            f"resumed from {path}: step {progress.step}, epoch {progress.epoch}, "
            f"{progress.samples_in_epoch} samples into it",
        )
        return progress
