"""Experiment tracking on the main process only, never blocking on the network.

Accelerate creates trackers in `init_trackers` on the main process alone, so a job is one wandb
run, not one per rank. Every run also writes `OUTPUT/logs/metrics.jsonl` (one JSON object per log
call), which needs no service and is what the tests read. Without wandb credentials, wandb runs
offline (`wandb sync` uploads it later) instead of waiting on a login prompt or the network.
"""

from __future__ import annotations

import json
import netrc
import os
import time
from pathlib import Path
from typing import Any

import accelerate.utils
import torch
from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker
from accelerate.utils import broadcast_object_list

from accel_common.console import format_metrics, progress_bar, say
from accel_common.errors import CheckpointError, ConfigError
from accel_common.monitoring.throughput import StepFlops, device_peak, mfu
from accel_common.run_folder.outputs import append_file, unfit_output

METRICS_FILE = "metrics.jsonl"
# where an epoch's mean training loss is logged (0.4 and before: eval/train_loss)
EPOCH_LOSS_KEYS = {
    "train_loss": "train/epoch_loss",
    "train_loss_partial": "train/epoch_loss_partial",
}


# the trackers Accelerate integrates (accelerate.tracking.LOGGER_TYPE_TO_CLASS), in its order
TRACKERS = tuple(LOGGER_TYPE_TO_CLASS)
# the package to install for each, where its name differs from the tracker's
PACKAGES = {"comet_ml": "comet-ml"}


def parse_report_to(report_to: str) -> list[str]:
    """`--report-to`: 'none', 'all' (every tracker whose package is installed) or a
    comma-separated list of TRACKERS, each of which must be installed; returns the list."""
    names = [n.strip() for n in str(report_to).split(",") if n.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [n for n in TRACKERS if tracker_installed(n)]
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(
                f"--report-to {report_to}: unknown tracker '{name}'; choose from "
                f"{', '.join(TRACKERS)}, all or none (several: --report-to wandb,tensorboard)"
            )
        if not tracker_installed(name):
            raise ConfigError(
                f"--report-to {name}: its package is not installed; pip install "
                f"{PACKAGES.get(name, name)}"
            )
    return list(dict.fromkeys(names))


def tracker_installed(name: str) -> bool:
    """Whether Accelerate finds `name`'s package (its own is_<name>_available check)."""
    return bool(getattr(accelerate.utils, f"is_{name}_available")())


class JSONLTracker(GeneralTracker):
    """Appends `{"step": ..., **values}` lines to `<logging_dir>/metrics.jsonl`."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, logging_dir: Path) -> None:
        super().__init__()
        self.path = Path(logging_dir) / METRICS_FILE
        self._file = None

    def start(self) -> None:  # called by init_trackers, on the main process only
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = append_file(self.path)  # never through a link planted there

    @property
    def tracker(self) -> Any:
        return self._file

    def store_init_configuration(self, values: dict) -> None:
        self.log({"config": values}, step=None)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record, default=str) + "\n")

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()


def has_wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def trackers_for(report_to: str, output_dir: Path) -> list[Any]:
    """The `log_with` list for `Accelerator`: the JSONL log plus what `--report-to` asks for."""
    return [JSONLTracker(Path(output_dir) / "logs"), *parse_report_to(report_to)]


def start_tracking(
    accelerator: Accelerator,
    *,
    project: str,
    run_name: str | None,
    output_dir: Path,
    config: dict[str, Any],
) -> None:
    """Initialise trackers (main process only, inside Accelerate) with the run's config."""
    wandb_wanted = any(str(t) == "wandb" for t in accelerator.log_with)
    if wandb_wanted and accelerator.is_main_process:
        os.environ.setdefault("WANDB_DIR", str(output_dir))
        if "WANDB_MODE" not in os.environ and not has_wandb_credentials():
            os.environ["WANDB_MODE"] = "offline"
            say(
                accelerator,
                "wandb: no credentials found, logging offline; upload later with `wandb sync`",
            )
    # the log refused on every process, before training, where the main process would refuse it
    refusal: list[str | None] = [None]
    if accelerator.is_main_process:
        refusal = [unfit_output(Path(output_dir) / "logs" / METRICS_FILE, Path(output_dir))]
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list(refusal)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])
    flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
    accelerator.init_trackers(
        project_name=project,
        config=flat,
        init_kwargs={"wandb": {"name": run_name, "dir": str(output_dir)}},
    )


class RunningMean:
    """Sums a per-step scalar on the device; reading it costs one all-reduce and one host sync.

    Calling `.item()` every step would stall the GPU queue; the loop calls `add` each step (an
    in-place add, no allocation) and `compute` only at logging intervals, on every process (the
    reduction is collective). The sums are resumable state (`state`, `restore`): a resumed run's
    means cover the steps the uninterrupted run's cover, bit-equal with as many processes.
    """

    def __init__(self) -> None:
        # the weighted sum and the weights' sum, on the device (each value weighs 1 unless
        # `add` is given its items); None while empty
        self.total: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.partial = False  # resumed from a checkpoint without sums: covers the steps since

    @property
    def has_values(self) -> bool:
        """Whether anything was added since the last compute (no host sync)."""
        return self.total is not None

    def add(self, value: torch.Tensor, weight: torch.Tensor | int | None = None) -> None:
        if self.total is None:
            self.total = torch.zeros((), dtype=torch.float32, device=value.device)
            self.weight = torch.zeros((), dtype=torch.float32, device=value.device)
        w = 1 if weight is None else weight
        self.total.add_(value.detach().float() * w)
        self.weight.add_(w)  # type: ignore[union-attr]

    def compute(self, accelerator: Accelerator) -> float:
        """Mean over all processes' values since the last compute; resets the sum."""
        if self.total is None:
            return float("nan")
        pair = torch.stack([self.total, self.weight])  # type: ignore[list-item]
        total, count = accelerator.reduce(pair, reduction="sum")
        self.total, self.weight, self.partial = None, None, False
        return (total / count).item()

    def state(self, accelerator: Accelerator) -> dict[str, list[float]]:
        """Every process's sum and count, for a checkpoint (collective: a gather)."""
        total = 0.0 if self.total is None else self.total.item()
        count = 0.0 if self.weight is None else self.weight.item()
        mine = torch.tensor([total, count], dtype=torch.float32, device=accelerator.device)
        pairs = accelerator.gather(mine).reshape(-1, 2).tolist()
        return {"sums": [p[0] for p in pairs], "counts": [p[1] for p in pairs]}

    def restore(self, saved: dict[str, list[float]], accelerator: Accelerator) -> None:
        """Put back the sums `state` saved: each process its own, or, resumed on another number
        of processes, an equal share of the total each (the mean is over all of them)."""
        sums, counts = saved["sums"], saved["counts"]
        if len(sums) == accelerator.num_processes:
            total, count = sums[accelerator.process_index], counts[accelerator.process_index]
        else:
            share = accelerator.num_processes
            total, count = sum(sums) / share, sum(counts) / share
        self.total = self.weight = None
        if count:
            device = accelerator.device
            self.total = torch.tensor(total, dtype=torch.float32, device=device)
            self.weight = torch.tensor(count, dtype=torch.float32, device=device)


class Throughput:
    """Samples per second between two reads, from wall time and the global batch."""

    def __init__(self) -> None:
        self.last_time = time.perf_counter()
        self.samples = 0

    def add(self, samples: int) -> None:
        self.samples += samples

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.samples / max(now - self.last_time, 1e-9)
        self.last_time, self.samples = now, 0
        return rate


class StepLogger:
    """The loop's bookkeeping: loss means, samples/s, TFLOP/s and MFU
    (accel_common.monitoring.throughput), the progress bar and tracker records.

    Per micro-batch it costs one in-place add on the device, per optimizer step a counter and a
    progress-bar tick; host syncs (`.item()`, all-reduce) happen only on logging steps. Every
    process calls it (the reductions are collective); only the main process prints and logs.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        *,
        total_steps: int,
        initial_step: int,
        log_every: int,
        global_batch_size: int,
        desc: str,
    ) -> None:
        self.accelerator = accelerator
        self.log_every = max(1, log_every)
        self.global_batch_size = global_batch_size
        self.window_loss, self.epoch_loss = RunningMean(), RunningMean()
        self.initial_step = initial_step
        self.last_epoch_loss: float | None = None  # a finished run evaluated again reports it
        self.postfix: dict[str, str] = {}  # what the bar shows after its counts: the last loss
        self.throughput = Throughput()
        self.flops = StepFlops(accelerator)  # the loop counts its first step
        self.peak, peak_line = device_peak(accelerator)
        say(accelerator, peak_line)
        self.bar = progress_bar(
            accelerator,
            total=total_steps,
            initial=initial_step,
            desc=desc,
            samples_per_step=global_batch_size,
        )

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` will be logged (so its grad norm is worth computing)."""
        return step % self.log_every == 0

    def add_loss(self, loss: torch.Tensor, items: torch.Tensor | int | None = None) -> None:
        self.window_loss.add(loss, items)
        self.epoch_loss.add(loss, items)

    def step(self, step: int, lr: float, grad_norm: torch.Tensor | None) -> float | None:
        """Count an optimizer step; on logging steps, reduce and log loss, the LR the step used,
        grad norm, speed, and return the logged loss (None on other steps)."""
        self.throughput.add(self.global_batch_size)
        self.bar.update()
        if not self.logs_at(step):
            return None
        partial = self.window_loss.partial
        record = {
            "train/loss": self.window_loss.compute(self.accelerator),
            "train/lr": lr,
            "train/samples_per_s": self.throughput.read(),
        }
        if grad_norm is not None:
            record["train/grad_norm"] = grad_norm.item()
        if partial:
            record["train/loss_partial"] = True
        if self.accelerator.scaler is not None:  # fp16: a collapsing scale means overflowing grads
            record["train/loss_scale"] = self.accelerator.scaler.get_scale()
        if self.flops.per_step is not None:
            record |= self.flops_record(self.flops.per_step, record["train/samples_per_s"])
        self.accelerator.log(record, step=step)
        self.postfix = {"loss": f"{record['train/loss']:.4f}"}
        if "train/tflops_per_device" in record:
            self.postfix["TFLOP/s"] = f"{record['train/tflops_per_device']:.3g}"
        if "train/mfu" in record:
            self.postfix["MFU"] = f"{100 * record['train/mfu']:.1f}%"
        # redrawn now: left to the bar's own 0.5 s refresh, fast steps showed a stale loss
        self.bar.set_postfix(self.postfix)
        return record["train/loss"]

    def flops_record(self, flops: float, samples_per_s: float) -> dict[str, float]:
        """A step's `flops` (all processes), the TFLOP/s each device achieved over the window of
        `samples_per_s` and, where its peak is known, their share of it."""
        steps_per_s = samples_per_s / self.global_batch_size
        tflops = flops / self.accelerator.num_processes * steps_per_s / 1e12
        record = {"train/flops_per_step": flops, "train/tflops_per_device": tflops}
        if self.peak:
            record["train/mfu"] = mfu(tflops, self.peak)
        return record

    def end_epoch(
        self, epoch: int, step: int, eval_metrics: dict[str, float], *, again: bool = False
    ) -> dict[str, float]:
        """Log the mean training loss since the last call and the evaluation metrics; print them
        once. An epoch in which nothing was trained has no training loss (a mean over no steps
        is NaN), except a finished run's last epoch evaluated `again`: it reports the run's."""
        mean, train = self.epoch_loss, {}
        if mean.has_values:
            partial = mean.partial
            self.last_epoch_loss = train["train_loss"] = mean.compute(self.accelerator)
            if partial:
                train["train_loss_partial"] = True
        else:
            mean.partial = False  # nothing since the resume: the next epoch's mean is whole
            if again and self.last_epoch_loss is not None:
                train["train_loss"] = self.last_epoch_loss
        metrics = {**train, **eval_metrics}
        # the epoch's training loss is a training metric: logged beside train/loss, not as an
        # evaluation (the returned metrics, the printed line and the export keep `train_loss`)
        logged = {EPOCH_LOSS_KEYS[k]: v for k, v in train.items()}
        if "train_loss" in train:  # the bar shows the latest loss logged, this epoch's mean
            self.postfix["loss"] = f"{train['train_loss']:.4f}"
            self.bar.set_postfix(self.postfix)
        self.accelerator.log(logged | {f"eval/{k}": v for k, v in eval_metrics.items()}, step=step)
        if self.accelerator.is_main_process:
            self.bar.write(f"epoch {epoch}: {format_metrics(metrics)}")
        return metrics

    def log_eval(self, step: int, eval_metrics: dict[str, float]) -> dict[str, float]:
        """Log an evaluation between epoch ends at `step`; print it once."""
        self.accelerator.log({f"eval/{k}": v for k, v in eval_metrics.items()}, step=step)
        if self.accelerator.is_main_process:
            self.bar.write(f"step {step}: {format_metrics(eval_metrics)}")
        return eval_metrics

    def state(self) -> dict[str, Any]:
        """The running sums, for a checkpoint (collective)."""
        return {
            "window": self.window_loss.state(self.accelerator),
            "epoch": self.epoch_loss.state(self.accelerator),
            "last_epoch": self.last_epoch_loss,
        }

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continue the means where a checkpoint's `state` left them. `None`, a checkpoint
        from before they were stored: the first window's mean (unless it starts at the resume)
        and the epoch's cover only the steps since the resume, and are marked partial."""
        if saved is None:
            self.window_loss.partial = self.initial_step % self.log_every != 0
            self.epoch_loss.partial = True
            return
        self.window_loss.restore(saved["window"], self.accelerator)
        self.epoch_loss.restore(saved["epoch"], self.accelerator)
        self.last_epoch_loss = saved["last_epoch"]

    def close(self) -> None:
        self.bar.close()
