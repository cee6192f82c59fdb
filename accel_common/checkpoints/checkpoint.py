"""Resumable training state: what a run needs to continue at the exact sample it stopped at.

`OUTPUT/checkpoints/step_N` holds `accelerator.save_state` (model, optimizer, scheduler, grad
scaler, each rank's RNG) plus `progress.json` (epoch, samples seen in it, optimizer step, batch
plan, every rank's running loss sums: a resumed epoch logs the uninterrupted run's mean) and
`manifest.json` (every file's size and hash, accel_common.checkpoints.checkpoint_files). It is
written to `step_N.tmp` and renamed only when complete, so a crash mid-save never produces a
"latest" that cannot load. A resume verifies the manifest and the progress record's invariants
before it loads anything, and reads no pickle with code in it. Only the loop uses it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, gather_object
from safetensors import SafetensorError

from accel_common.batch_lr.batching import BatchPlan
from accel_common.checkpoints.checkpoint_files import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MANIFEST_KEY,
    PROGRESS_FILE,
    check_dcp_folders,
    check_deepspeed_files,
    checkpoint_files,
    custom_states_read_weights_only,
    detail_of,
    first_unloadable,
    load_state_file,
    read_rng_state,
    require_manifest,
    set_rng_state,
    verify_files,
    write_manifest,
)
from accel_common.checkpoints.export import (
    WRITE_ADVICE,
    as_write_error,
    disk_full,
    strict_json,
    write_failure,
)
from accel_common.checkpoints.progress import TrainProgress, first_difference, progress_problem
from accel_common.checkpoints.ties import recording_ties
from accel_common.errors import CheckpointError, RecipeError
from accel_common.run_folder.outputs import write_output

CHECKPOINTS = "checkpoints"
PROCESS_STATE = "process_state_{}.pt"  # a process's own extra state (the loader's fetch RNG)
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
        complete = match and not path.is_symlink() and (path / PROGRESS_FILE).is_file()
        if complete and (run_id is None or checkpoint_run(path).get("id") == run_id):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def checkpoint_run(path: Path) -> dict[str, Any]:
    """The run a checkpoint belongs to: {"id", "identity"}; {} for one saved before runs had
    identities (or unreadable: loading it reports that)."""
    try:
        return json.loads((Path(path) / PROGRESS_FILE).read_text()).get("run") or {}
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}


def remove_unfinished_saves(
    accelerator: Accelerator, output_dir: Path, *, refuse_unexpected: bool = False
) -> None:
    """Delete `step_N.tmp` folders left by a crash during a save (main process; collective); a
    link of that name is removed itself, never followed (a save would write through it). With
    `refuse_unexpected`, first refuse a `step_N` no save wrote (`unexpected_checkpoint`)."""
    root = Path(output_dir) / CHECKPOINTS
    found = [None]
    if accelerator.is_main_process and refuse_unexpected:
        found = [unexpected_checkpoint(output_dir)]
    if refuse_unexpected and accelerator.num_processes > 1:
        found = broadcast_object_list(found)
    if found[0] is not None:
        raise CheckpointError(found[0])
    if accelerator.is_main_process and root.is_dir():
        for leftover in root.glob("step_*.tmp"):
            if leftover.is_symlink() or not leftover.is_dir():
                leftover.unlink(missing_ok=True)
            else:
                shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()


def unexpected_checkpoint(output_dir: Path) -> str | None:
    """Why a `step_N` entry of OUTPUT/checkpoints is none a save wrote (a link, a file, a folder
    without progress.json), or None. A save renames its folder into place only when complete,
    so such an entry was put there by hand or by an interrupted copy: resuming past it, pruning
    it or saving over it would lose or misread it, so a run refuses it before training."""
    root = Path(output_dir) / CHECKPOINTS
    if os.path.lexists(root) and (root.is_symlink() or not root.is_dir()):
        return f"{root} is not a folder; a run keeps its checkpoints there: move it away"
    entries = sorted(root.iterdir()) if root.is_dir() else []
    for path in (p for p in entries if _STEP_DIR.match(p.name)):
        if path.is_symlink():
            what = f"a symbolic link to {path.resolve()}"
        elif not path.is_dir():
            what = "not a folder"
        elif not (path / PROGRESS_FILE).is_file():
            what = f"an incomplete checkpoint (no {PROGRESS_FILE}: an interrupted copy?)"
        else:
            continue
        return (
            f"{path} is {what}; a run writes every step_N folder itself, renamed into place "
            f"only when complete, so it neither resumes from, prunes nor saves over this one: "
            f"move it out of {root} (or resume a copy of the run elsewhere), then run again"
        )
    return None


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: Path,
    progress: TrainProgress,
    *,
    plan: BatchPlan,
    keep_last: int = 2,
    run: dict[str, Any] | None = None,
    process_state: dict[str, Any] | None = None,
) -> Path:
    """Save resumable state for `progress.step`; every process must call this (collective).

    `run` ({"id", "identity"}, see accel_common.training.run) is recorded so that a resume can tell
    this run from another one in the same folder; pruning to `keep_last` touches only the
    checkpoints of the same run. `process_state`: this process's own extra state (tensors,
    numbers, numpy arrays), read back by `read_process_state`.
    """
    final = checkpoint_dir(output_dir, progress.step)
    tmp = final.with_name(final.name + ".tmp")
    # on every process, before anything is written: a value JSON cannot hold stops them all
    record = {
        "progress": asdict(progress),
        "batch_plan": plan.as_dict(),
        "run": run,
        MANIFEST_KEY: MANIFEST_FORMAT,  # a resume missing the manifest knows it was removed
    }
    text = strict_json(record, final / PROGRESS_FILE)
    remove_unfinished_saves(accelerator, output_dir)
    try:
        with recording_ties(accelerator):  # tied weights: every name restorable (ties.py)
            accelerator.save_state(str(tmp))
        if process_state is not None:
            torch.save(process_state, tmp / PROCESS_STATE.format(accelerator.process_index))
        accelerator.wait_for_everyone()  # every rank's RNG file is in place
        if accelerator.is_main_process:
            write_output(tmp / PROGRESS_FILE, text)  # never through a link planted there
            write_manifest(tmp, {k: json.loads(text)[k] for k in ("progress", "batch_plan")})
            if final.is_symlink():  # the link itself goes, not what it names
                final.unlink()
            elif final.exists():
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
    root = Path(output_dir) / CHECKPOINTS
    if path.name.endswith(".tmp") and _STEP_DIR.match(path.name.removesuffix(".tmp")):
        raise CheckpointError(
            f"--resume {resume}: an unfinished save (a crash during the save left it; saves are "
            f"renamed to step_N only when complete), kept as it is; resume a complete step_N "
            f"folder under {root}, e.g. --resume latest"
        )
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint folder")
    if not (path / PROGRESS_FILE).is_file():
        raise CheckpointError(
            f"--resume {resume}: {PROGRESS_FILE} is missing, so this save never completed "
            f"(or is not a checkpoint of this project); resume a complete step_N folder (those "
            f"under {root}: `ls {root}/*/{PROGRESS_FILE}`)"
        )
    return path


def load_checkpoint(
    accelerator: Accelerator,
    path: Path,
    plan: BatchPlan,
    *,
    accept: Callable[[Path, TrainProgress, int, dict[str, Any]], None] | None = None,
    allow_unverified: bool = False,
) -> tuple[TrainProgress, dict[str, Any]]:
    """Restore model, optimizer, scheduler, scaler and RNG from `path`; return its progress and
    its run record ({"id", "identity"}).

    Before anything is loaded: the files must be the ones the save wrote (manifest.json; a
    checkpoint without one only with `allow_unverified`), and the progress record must hold
    together (`check_progress`). `accept(path, progress, saved global
    batch, run record)` then refuses a checkpoint of another run
    (accel_common.training.run.RunCheck). Refused too: a position this launch's plan cannot reach,
    tensors whose shapes do not fit the model, and any pickle that asks for more than tensors and
    numbers (nothing in it runs).
    """
    failure = None
    try:
        progress, run, rng = _checked_before_loading(
            accelerator, path, plan, accept, allow_unverified
        )
    except RecipeError as err:  # every process refuses, not only the one that found it
        failure = err
    refusals = gather_object([None if failure is None else str(failure)])
    if failure is not None:
        raise failure
    if any(refusals):
        raise CheckpointError(next(r for r in refusals if r))
    try:
        with custom_states_read_weights_only():
            accelerator.load_state(str(path))
    except CheckpointError:
        raise
    except Exception as err:  # torch/safetensors raise many types for truncated or corrupt files
        mismatch = shape_mismatch(str(err))
        if mismatch:
            raise CheckpointError(f"{path}: {mismatch}; were the model flags the same?") from err
        raise first_unloadable(path) or CheckpointError(
            f"checkpoint {path} is corrupt or truncated and cannot be loaded ({detail_of(err)}); "
            "resume from an earlier step_N folder instead"
        ) from err
    if rng is not None:
        set_rng_state(rng, path)
    check_schedulers(accelerator, path, progress.step)
    return progress, run


def _checked_before_loading(
    accelerator: Accelerator,
    path: Path,
    plan: BatchPlan,
    accept: Callable[[Path, TrainProgress, int, dict[str, Any]], None] | None,
    allow_unverified: bool,
) -> tuple[TrainProgress, dict[str, Any], dict[str, Any] | None]:
    """Everything `load_checkpoint` checks before it loads: progress, run record, RNG state."""
    checkpoint_files(path)  # regular files only: a FIFO would block its reader
    try:
        record = json.loads((path / PROGRESS_FILE).read_text())
        # a record from before they were stored: None, which its arithmetic check passes over
        progress = TrainProgress(**{"epoch_samples": None, **record["progress"]})
        saved_plan = BatchPlan(**{k: int(v) for k, v in record["batch_plan"].items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise CheckpointError(
            f"{path / PROGRESS_FILE} is unreadable ({detail_of(err)}); resume from an earlier "
            "step_N folder"
        ) from None
    manifest = require_manifest(
        path,
        record,
        allow_unverified=allow_unverified,
        use="resume",
        warn=accelerator.is_main_process,
    )
    check_progress(path, progress, saved_plan, manifest, allow_unverified)
    if manifest is not None:  # the main process hashes; the others check names and sizes
        verify_files(path, manifest, hashes=accelerator.is_main_process)
    run = record.get("run") or {}
    if accept is not None:
        accept(path, progress, saved_plan.global_batch_size, run)
    progress.batches_to_skip(plan)  # fails early if the position cannot be mapped
    check_layout(accelerator, path)
    rng = read_rng_state(path, accelerator.process_index, saved_plan.num_processes)
    check_dcp_folders(path)  # FSDP's sharded state: DCP itself would unpickle it unchecked
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        check_deepspeed_files(path)  # DeepSpeed's engine unpickles its files unchecked
    return progress, run, rng


def read_process_state(path: Path, process_index: int) -> dict[str, Any] | None:
    """This process's extra state in a checkpoint (weights-only), or None if it saved none."""
    found = Path(path) / PROCESS_STATE.format(process_index)
    return load_state_file(found) if found.is_file() else None


def saved_sharding(path: Path) -> str | None:
    """'FSDP' or 'DeepSpeed' for a checkpoint saved sharded by one of them, else None."""
    if any(path.glob("pytorch_model_fsdp_*")):
        return "FSDP"
    if (path / "pytorch_model").is_dir() or (path / "latest").is_file():
        return "DeepSpeed"
    return None


def check_layout(accelerator: Accelerator, path: Path) -> None:
    """A checkpoint is resumed under the sharding it was saved with: Accelerate would look for
    files the other layout does not have and report the folder as corrupt."""
    saved = saved_sharding(path)
    kinds = {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed"}
    now = kinds.get(accelerator.distributed_type)
    if saved == now:
        return
    if saved is None:
        raise CheckpointError(
            f"{path} was saved without sharding, and this launch runs {now}: resume it with the "
            "launch config it was saved with (no FSDP/DeepSpeed)"
        )
    merge = (
        f"accel-recipes convert {path} OUT"
        if saved == "FSDP"
        else f"python {path / 'zero_to_fp32.py'} {path} OUT --safe_serialization"
    )
    raise CheckpointError(
        f"{path} is an intact {saved}-sharded checkpoint, and this launch runs "
        f"{now or 'without sharding'}: resume it under the {saved} launch config it was saved "
        f"with (e.g. --config_file accelerate_configs/{saved.lower()}_*.yaml), or merge its "
        f"weights with `{merge}` (docs/sharded.md)"
    )


def check_progress(
    path: Path,
    progress: TrainProgress,
    saved: BatchPlan,
    manifest: dict[str, Any] | None,
    allow_unverified: bool,
) -> None:
    """The progress record holds together, or it was edited or damaged: refused naming the
    field. Its fields equal the manifest's copy; counts are whole and not negative; sums are
    finite; the step is the folder's; the position is whole rounds of the saved batch plan and
    its own arithmetic holds. A record without `epoch_samples` (older, or the field removed:
    its position cannot be checked) only with `allow_unverified`."""
    where = path / PROGRESS_FILE
    if manifest is not None:
        now = {"progress": asdict(progress), "batch_plan": saved.as_dict()}
        edited = first_difference(now, manifest["progress"])
        if edited is not None:
            name, value, was = edited
            raise CheckpointError(
                f"{where}: {name} is {value!r}, {was!r} when saved ({MANIFEST_FILE}); the file "
                "was edited or damaged: resume from an earlier step_N folder"
            )
    problem = progress_problem(progress, saved)
    if problem is None and progress.epoch_samples is None and not allow_unverified:
        raise CheckpointError(
            f"{where}: epoch_samples is missing (saved before version 0.2.0, or removed), so "
            "where the run stands cannot be checked against its steps and its data; resume it "
            "with --allow-unverified if you trust it"
        )
    if problem is None and _STEP_DIR.match(path.name) and checkpoint_step(path) != progress.step:
        problem = f"step is {progress.step} in the folder of step {checkpoint_step(path)}"
    if problem is not None:
        raise CheckpointError(
            f"{where}: {problem}; the file was edited or damaged: resume from an earlier step_N "
            "folder"
        )


def check_schedulers(accelerator: Accelerator, path: Path, step: int) -> None:
    """An LR scheduler steps once per optimizer step: its restored count is the checkpoint's
    step, or one of the two files was edited or damaged."""
    for index, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and obj.last_epoch != step:
            raise CheckpointError(
                f"{path / f'custom_checkpoint_{index}.pkl'}: the LR scheduler is at step "
                f"{obj.last_epoch}, {PROGRESS_FILE} at step {step}; one of them was edited or "
                "damaged: resume from an earlier step_N folder"
            )


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
