"""Where a run is (`TrainProgress`: the exact sample to resume at, with any number of
processes) and whether a saved record of it holds together on its own: a resume refuses a
record that no save could have written, naming the field, before it trains on the position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from accel_common.batch_lr.batching import BatchPlan
from accel_common.errors import CheckpointError


@dataclass
class TrainProgress:
    """Where a run is: enough to resume at the exact sample, with any number of processes."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    skipped_steps: int = 0  # fp16: optimizer steps the loss scaler skipped after an overflow
    nonfinite_skipped: int = 0  # --on-nonfinite skip: steps skipped on every process
    # early stopping (TrainLoop's `monitor`): the best value so far, the metrics of the epoch
    # that reached it, epochs since, and whether the run stopped for want of improvement
    best: float | None = None
    best_metrics: dict[str, float] = field(default_factory=dict)
    bad_epochs: int = 0
    stopped: bool = False
    # seconds spent training (in loop.batches()) up to this point, over every launch of the run
    train_seconds: float = 0.0
    # the logged loss means' running sums, every process's (StepLogger.state); None in a
    # checkpoint saved before they were stored
    loss_sums: dict[str, Any] | None = None
    # the FLOPs of an optimizer step, all processes', counted on the run's first (StepFlops): a
    # resumed run does not count again, which would round its next step differently
    flops_per_step: float | None = None
    # each finished epoch's samples (every process's micro-batches of `per_round` samples),
    # run-length coded as [[samples, per_round, epochs], ...]: with them the position's
    # arithmetic is checked on its own and against the data (`position_problem`,
    # `data_problem`); None in a checkpoint saved before they were recorded
    epoch_samples: list[list[int]] | None = field(default_factory=list)

    def finish_epoch(self, plan: BatchPlan) -> None:
        """The epoch's last micro-batch is done: record its samples, start the next epoch."""
        per_round = plan.per_device_batch_size * plan.num_processes
        if self.epoch_samples is not None:
            last = self.epoch_samples[-1] if self.epoch_samples else None
            if last is not None and last[:2] == [self.samples_in_epoch, per_round]:
                last[2] += 1
            else:
                self.epoch_samples.append([self.samples_in_epoch, per_round, 1])
        self.epoch, self.samples_in_epoch = self.epoch + 1, 0

    def batches_to_skip(self, plan: BatchPlan, loader: Any = None) -> int:
        """Per-process micro-batches of the current epoch that were already trained on; with the
        `loader` (of a known length), the record is checked against the data first."""
        per_round = plan.per_device_batch_size * plan.num_processes
        if self.samples_in_epoch % per_round:
            raise CheckpointError(
                f"the checkpoint stopped {self.samples_in_epoch} samples into epoch {self.epoch},"
                f" which is not a whole number of {per_round}-sample rounds with this launch's "
                f"batch plan ({plan.describe()}); resume with the original number of processes"
            )
        try:
            rounds = len(loader) if loader is not None else None
        except TypeError:  # an iterable dataset's loader: no length to check against
            rounds = None
        problem = self.data_problem(rounds * per_round, plan) if rounds is not None else None
        if problem is not None:
            raise CheckpointError(
                f"the checkpoint's {problem}: its record was edited or damaged (or the data "
                "changed); resume from an earlier step_N folder"
            )
        return self.samples_in_epoch // per_round

    def data_problem(self, epoch_size: int, plan: BatchPlan) -> str | None:
        """What in the position no pass over this data could reach, where an epoch is
        `epoch_size` samples in `plan`'s rounds: an epoch recorded at another size (a launch
        with another number of processes, whose rounds divide the same global batch, pads it by
        less than a round either way), or a position past the epoch's end."""
        per_round = plan.per_device_batch_size * plan.num_processes
        if self.samples_in_epoch > epoch_size:  # it would start the next epoch early
            return (
                f"samples_in_epoch {self.samples_in_epoch} is past the end of epoch {self.epoch} "
                f"({epoch_size} samples)"
            )
        for samples, saved_round, _ in self.epoch_samples or []:
            if saved_round == per_round:
                fits = samples == epoch_size
            else:  # another launch's rounds divide the same global batch, each pads < a round
                near = abs(samples - epoch_size) < saved_round + per_round
                fits = near and plan.global_batch_size % saved_round == 0
            if not fits:
                return (
                    f"epoch_samples records an epoch of {samples} samples in rounds of "
                    f"{saved_round}, while an epoch of this data is {epoch_size} in rounds of "
                    f"{per_round}"
                )
        return None


_COUNTS = ("step", "epoch", "samples_in_epoch", "skipped_steps", "nonfinite_skipped", "bad_epochs")


def first_difference(now: Any, was: Any, name: str = "") -> tuple[str, Any, Any] | None:
    """The first entry where two JSON records differ: (dotted name, value now, value then)."""
    if isinstance(now, dict) and isinstance(was, dict):
        for key in [*now, *(k for k in was if k not in now)]:
            found = first_difference(now.get(key), was.get(key), f"{name}.{key}".lstrip("."))
            if found is not None:
                return found
        return None
    if isinstance(now, list) and isinstance(was, list) and len(now) == len(was):
        for index, (a, b) in enumerate(zip(now, was, strict=True)):
            if (found := first_difference(a, b, f"{name}[{index}]")) is not None:
                return found
        return None
    same = now == was or (now != now and was != was)  # NaN read back from JSON equals itself
    return None if same and type(now) is type(was) else (name.removeprefix("progress."), now, was)


def progress_problem(progress: TrainProgress, saved: BatchPlan) -> str | None:
    """What in a progress record cannot come from a save with batch plan `saved`, or None."""
    plan = (saved.per_device_batch_size, saved.num_processes, saved.grad_accum_steps)
    if min(plan) < 1 or math.prod(plan) != saved.global_batch_size:
        return f"batch_plan {saved.as_dict()} is no batch plan"
    for name in _COUNTS:
        value = getattr(progress, name)
        if type(value) is not int or value < 0:
            return f"{name} is {value!r}, not a whole number >= 0"
    if progress.skipped_steps > progress.step or progress.nonfinite_skipped > progress.step:
        return "more skipped steps than steps"
    numbers = {"train_seconds": progress.train_seconds, "best": progress.best}
    numbers["flops_per_step"] = progress.flops_per_step
    numbers.update({f"best_metrics.{k}": v for k, v in progress.best_metrics.items()})
    for name, value in numbers.items():
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            return f"{name} is {value!r}, not a finite number"
    if progress.train_seconds < 0 or type(progress.stopped) is not bool:
        return "train_seconds is negative" if progress.train_seconds < 0 else "stopped is no bool"
    per_round = saved.per_device_batch_size * saved.num_processes
    if progress.samples_in_epoch % per_round:
        return (
            f"samples_in_epoch {progress.samples_in_epoch} is not a whole number of the saved "
            f"plan's {per_round}-sample rounds ({saved.describe()})"
        )
    if progress.samples_in_epoch > progress.step * saved.global_batch_size:
        return (
            f"samples_in_epoch {progress.samples_in_epoch} is more than the "
            f"{progress.step * saved.global_batch_size} samples of {progress.step} steps"
        )
    return position_problem(progress, saved) or loss_sums_problem(
        progress.loss_sums, saved.num_processes
    )


def position_problem(progress: TrainProgress, saved: BatchPlan) -> str | None:
    """The position's own arithmetic: every optimizer step takes one global batch (windows of
    micro-batches carry across epoch ends, never closed early), so the finished epochs'
    samples (`epoch_samples`, numbering `epoch` epochs) and this epoch's make `step` global
    batches; only a run stopped early at an epoch's end may hold a partial window more. A record
    that does not (samples_in_epoch 0 at step 20) would replay or skip data."""
    runs = progress.epoch_samples
    if runs is None:
        return None  # saved before they were recorded (check_progress: and before manifests)
    shapes = isinstance(runs, list) and all(isinstance(r, list) and len(r) == 3 for r in runs)
    if not shapes or any(type(v) is not int or v < 0 for r in runs for v in r):
        return f"epoch_samples is {runs!r}, not a list of [samples, per_round, epochs] counts"
    if any(n < 1 or per_round < 1 or samples % per_round for samples, per_round, n in runs):
        return f"epoch_samples is {runs!r}: an entry of no epochs or not in whole rounds"
    finished = sum(n for _, _, n in runs)
    if finished != progress.epoch:
        return f"epoch is {progress.epoch}, while epoch_samples records {finished} finished epochs"
    seen = sum(samples * n for samples, _, n in runs) + progress.samples_in_epoch
    window = seen - progress.step * saved.global_batch_size
    if window != 0 and not (progress.stopped and 0 < window < saved.global_batch_size):
        return (
            f"samples_in_epoch is {progress.samples_in_epoch} at step {progress.step}: with the "
            f"finished epochs' (epoch_samples) that makes {seen} samples, where {progress.step} "
            f"steps of the saved plan's global batch {saved.global_batch_size} take "
            f"{progress.step * saved.global_batch_size}"
        )
    return None


def loss_sums_problem(saved: Any, processes: int) -> str | None:
    """The loss sums hold a finite sum and a whole, non-negative count per saved process."""
    if saved is None:
        return None  # saved before they were stored: the loop marks its means partial
    try:
        for part in ("window", "epoch"):
            sums, counts = saved[part]["sums"], saved[part]["counts"]
            if len(sums) != processes or len(counts) != processes:
                return f"loss_sums.{part} hold {len(sums)} sums for {processes} processes"
            for value in sums:
                if type(value) not in (int, float) or not math.isfinite(value):
                    return f"loss_sums.{part}.sums holds {value!r}, not a finite number"
            for value in counts:  # a share after a resume on another process count: a float
                if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
                    return f"loss_sums.{part}.counts holds {value!r}, not a finite number >= 0"
        last = saved["last_epoch"]
    except (KeyError, TypeError) as err:
        return f"loss_sums is malformed ({type(err).__name__}: {err})"
    if last is not None and (type(last) not in (int, float) or not math.isfinite(last)):
        return f"loss_sums.last_epoch is {last!r}, not a finite number"
    return None
