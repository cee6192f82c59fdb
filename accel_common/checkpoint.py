"""Resumable training state: what a run needs to continue at the exact sample it stopped at.

`OUTPUT/checkpoints/step_N` holds `accelerator.save_state` (model, optimizer, scheduler, grad
scaler, each rank's RNG) plus `progress.json` (epoch, samples seen in it, optimizer step, batch
plan, every rank's running loss sums: a resumed epoch logs the uninterrupted run's mean). It
is written to `step_N.tmp` and renamed only when complete, and `progress.json` is written last,
so a crash mid-save never produces a "latest" that cannot load. Only the loop uses it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from safetensors import SafetensorError

from accel_common.batching import BatchPlan
from accel_common.errors import CheckpointError
from accel_common.export import (
    WRITE_ADVICE,
    as_write_error,
    disk_full,
    strict_json,
    write_failure,
)

CHECKPOINTS = "checkpoints"
PROGRESS_FILE = "progress.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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

    def batches_to_skip(self, plan: BatchPlan) -> int:
        """Per-process micro-batches of the current epoch that were already trained on."""
        per_round = plan.per_device_batch_size * plan.num_processes
        if self.samples_in_epoch % per_round:
            raise CheckpointError(
                f"the checkpoint stopped {self.samples_in_epoch} samples into epoch {self.epoch},"
                f" which is not a whole number of {per_round}-sample rounds with this launch's "
                f"batch plan ({plan.describe()}); resume with the original number of processes"
            )
        return self.samples_in_epoch // per_round


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step_{step}"


def checkpoint_step(path: Path) -> int:
    """The optimizer step of a `step_N` checkpoint folder."""
    return int(Path(path).name.removeprefix("step_"))


def list_checkpoints(output_dir: Path, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (renamed from .tmp, with progress.json), oldest first; with
    `run_id`, only that run's."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        complete = match and (path / PROGRESS_FILE).is_file()
        if complete and (run_id is None or checkpoint_run(path).get("id") == run_id):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def checkpoint_run(path: Path) -> dict[str, Any]:
    """The run a checkpoint belongs to: {"id", "identity"}; {} for one saved before runs had
    identities (or unreadable: loading it reports that)."""
    try:
        return json.loads((Path(path) / PROGRESS_FILE).read_text()).get("run") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def remove_unfinished_saves(accelerator: Accelerator, output_dir: Path) -> None:
    """Delete `step_N.tmp` folders left by a crash during a save (main process; collective)."""
    root = Path(output_dir) / CHECKPOINTS
    if accelerator.is_main_process and root.is_dir():
        for leftover in root.glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: Path,
    progress: TrainProgress,
    *,
    plan: BatchPlan,
    keep_last: int = 2,
    run: dict[str, Any] | None = None,
) -> Path:
    """Save resumable state for `progress.step`; every process must call this (collective).

    `run` ({"id", "identity"}, see accel_common.run) is recorded so that a resume can tell
    this run from another one in the same folder; pruning to `keep_last` touches only the
    checkpoints of the same run.
    """
    final = checkpoint_dir(output_dir, progress.step)
    tmp = final.with_name(final.name + ".tmp")
    # on every process, before anything is written: a value JSON cannot hold stops them all
    record = {"progress": asdict(progress), "batch_plan": plan.as_dict(), "run": run}
    text = strict_json(record, final / PROGRESS_FILE)
    remove_unfinished_saves(accelerator, output_dir)
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()  # every rank's RNG file is in place
        if accelerator.is_main_process:
            (tmp / PROGRESS_FILE).write_text(text)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
    except (OSError, RuntimeError, SafetensorError) as raw:  # torch.save's full disk: RuntimeError
        if (err := as_write_error(raw, tmp)) is None:
            raise
        if accelerator.is_main_process:  # never complete; on a full disk, space again
            shutil.rmtree(tmp, ignore_errors=True)
        latest = list_checkpoints(output_dir)
        last = (
            f"the last complete checkpoint is {latest[-1]}"
            if latest
            else "there is no complete checkpoint yet"
        )
        raise CheckpointError(
            f"{write_failure(err)} while saving {final.name}; {last} (nothing of {final.name} "
            f"was kept in {final.parent}): {WRITE_ADVICE[disk_full(err)]}, then continue with "
            "--resume latest"
        ) from None
    if accelerator.is_main_process:
        run_id = (run or {}).get("id")
        for old in list_checkpoints(output_dir, run_id)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def resolve_resume(resume: str | None, output_dir: Path) -> Path | None:
    """`latest` -> newest complete checkpoint (None if there is none yet), else a given path."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint folder")
    if not (path / PROGRESS_FILE).is_file():
        raise CheckpointError(
            f"--resume {resume}: {PROGRESS_FILE} is missing, so this save never completed "
            f"(or is not a checkpoint of this project); pick another folder under "
            f"{Path(output_dir) / CHECKPOINTS} or use --resume latest"
        )
    return path


def load_checkpoint(
    accelerator: Accelerator,
    path: Path,
    plan: BatchPlan,
    *,
    accept: Callable[[Path, TrainProgress, int, dict[str, Any]], None] | None = None,
) -> tuple[TrainProgress, dict[str, Any]]:
    """Restore model, optimizer, scheduler, scaler and RNG from `path`; return its progress and
    its run record ({"id", "identity"}).

    `accept(path, progress, saved global batch, run record)` refuses a checkpoint of another
    run before anything is restored (accel_common.run.RunCheck). Refused here: a missing or
    truncated file, a position this launch's plan cannot reach, tensors whose shapes do not fit
    the model.
    """
    try:
        record = json.loads((path / PROGRESS_FILE).read_text())
        progress = TrainProgress(**record["progress"])
        saved_plan = record["batch_plan"]
        saved_global = int(saved_plan["global_batch_size"])
        saved_processes = int(saved_plan["num_processes"])
        check_loss_sums(progress.loss_sums, saved_processes)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path / PROGRESS_FILE} is unreadable: {err}") from err
    run = record.get("run") or {}
    if accept is not None:
        accept(path, progress, saved_global, run)
    progress.batches_to_skip(plan)  # fails early if the position cannot be mapped
    check_rng_file(path, accelerator.process_index, saved_processes)
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # torch/safetensors raise many types for truncated or corrupt files
        mismatch = shape_mismatch(str(err))
        if mismatch:
            raise CheckpointError(f"{path}: {mismatch}; were the model flags the same?") from err
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated and cannot be loaded "
            f"({type(err).__name__}: {err}); resume from an earlier step_N folder instead"
        ) from err
    return progress, run


def check_loss_sums(saved: dict[str, Any] | None, processes: int) -> None:
    """The loss sums hold a number per saved process, or the file was edited or damaged
    (ValueError, KeyError or TypeError, which `load_checkpoint` reports in one line)."""
    if saved is None:
        return  # saved before they were stored: the loop marks its means partial
    for part in (saved["window"], saved["epoch"]):
        sums, counts = [float(v) for v in part["sums"]], [float(v) for v in part["counts"]]
        if len(sums) != processes or len(counts) != processes:
            raise ValueError(f"loss_sums hold {len(sums)} sums for {processes} processes")
    if saved["last_epoch"] is not None:
        float(saved["last_epoch"])


def check_rng_file(path: Path, process_index: int, saved_processes: int) -> None:
    """This process's RNG state must load: Accelerate skips a missing or broken one silently,
    and the resumed run would then draw other dropout masks and noise than the original."""
    if process_index >= saved_processes:
        return  # more processes than at the save: Accelerate seeds the new ones itself
    rng_file = Path(path) / f"random_states_{process_index}.pkl"
    try:
        # our own file, written by Accelerate's save_state: numpy's RNG state needs pickle
        torch.load(rng_file, weights_only=False)
    except Exception as err:  # missing, truncated or not a pickle: many exception types
        raise CheckpointError(
            f"{rng_file} is missing or truncated ({type(err).__name__}); resume from an earlier "
            "step_N folder instead"
        ) from err


_SIZE_MISMATCH = re.compile(
    r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
    r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)"
)


def shape_mismatch(message: str) -> str | None:
    """'shape mismatch: weight X is [A] in the checkpoint, [B] in the model' from torch's error."""
    found = _SIZE_MISMATCH.findall(message)
    if not found:
        return None
    first = "; ".join(
        f"weight {n} is {a} in the checkpoint, {b} in the model" for n, a, b in found[:3]
    )
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return f"shape mismatch: {first}{more}"
