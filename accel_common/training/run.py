"""A training run: its recorded config, its identity, its output folder, its checkpoints' owner.

`Run.open` does everything a run does before its first step: it records the config, computes
the run's identity (every setting but the adjustable ones, the recipe, the global batch, the
content fingerprint of the files its data reader opens), prints the plan, claims the output
folder (or moves an old run aside with --overwrite), resumes (refusing another run's
checkpoint, naming the flag that differs) and starts the trackers. The loop
(accel_common.training.loop) only counts steps; it saves and exports through the `Run`, which
records the run in every checkpoint and export.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from safetensors.torch import load_file

from accel_common.batch_lr.batching import BatchPlan
from accel_common.batch_lr.lr import LRSchedule
from accel_common.checkpoints.checkpoint import (
    TrainProgress,
    checkpoint_step,
    list_checkpoints,
    load_checkpoint,
    read_process_state,
    remove_unfinished_saves,
    resolve_resume,
    save_checkpoint,
)
from accel_common.checkpoints.export import (
    META_FILE,
    MODEL_FILE,
    export_model,
    intact_weights,
    read_export_metadata,
    write_export,
)
from accel_common.checkpoints.hf_layout import read_hf_layout
from accel_common.console import print_banner, say
from accel_common.data.fingerprint import (
    LISTED_FILES,
    data_hash_cache,
    files_fingerprint,
    hash_cache_file,
    refuse_other_data,
)
from accel_common.errors import CheckpointError, ConfigError
from accel_common.hardware.accelerator import ONE_STREAM, launcher_restart, split_rng_streams
from accel_common.hardware.compilation import compile_line
from accel_common.hardware.speed import speed_lines
from accel_common.monitoring.tracking import METRICS_FILE, start_tracking
from accel_common.run_folder.outputs import hold_output_dir
from accel_common.settings import DATA_KEY, describe_differences
from accel_common.training.ema import WeightEMA

# what a resume never reports as changed: how this launch was asked to start
LAUNCH_SETTINGS = frozenset({"resume", "overwrite", "overwrite_later", "allow_unverified"})
BEST_DIR = "best"  # the best epoch's export, with a `monitor`


@dataclass(frozen=True)
class StartRequest:
    """How this launch starts (--resume and the flags that go with it); never in the identity."""

    resume: str | None = None
    overwrite: bool = False
    overwrite_later: bool = False
    allow_unverified: bool = False


@dataclass(frozen=True)
class RunConfig:
    """What a run records: every setting and derived value (`values`), which of them may change
    on a resume (`adjustable`), which were computed from the data (`derived`, named as such),
    and the settings' declared defaults (what a checkpoint that predates a setting ran with)."""

    recipe: str
    values: dict[str, Any]
    adjustable: frozenset[str] = frozenset()
    derived: frozenset[str] = frozenset()
    defaults: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """Every value as it reads back from JSON (recorded with checkpoints)."""
        return json.loads(json.dumps(self.values, default=str))


@dataclass(frozen=True)
class Tracking:
    """Where the trackers log (--wandb-project, --wandb-name)."""

    project: str | None = None
    run_name: str | None = None


class Run:
    """One training run's identity, folder and checkpoints; made by `Run.open`."""

    def __init__(
        self,
        accelerator: Accelerator,
        plan: BatchPlan,
        config: RunConfig,
        output_dir: Path,
        identity: dict[str, Any],
        schedule: LRSchedule,
        data_digests: dict[str, str] | None = None,
    ) -> None:
        self.accelerator, self.plan, self.config = accelerator, plan, config
        self.recipe, self.schedule = config.recipe, schedule
        self.output_dir, self.identity = Path(output_dir), identity
        self.total_steps = schedule.total_steps
        self.data_digests = data_digests  # each data file's digest, by name (None: too many)
        self.id, self.progress = "", TrainProgress()
        self.last_saved: Path | None = None
        self.finished_export: Path | None = None  # a finished run's export, left as it is
        self.resumed_state: dict[str, Any] | None = None  # this process's, from the checkpoint
        self.ema = WeightEMA()  # --ema-decay's (Run.open's `ema`): what the exports hold

    @classmethod
    def open(
        cls,
        accelerator: Accelerator,
        plan: BatchPlan,
        schedule: LRSchedule,
        config: RunConfig,
        *,
        output_dir: Path,
        data_dir: Path | None = None,
        data_files: Mapping[str, Path] | None = None,
        start: StartRequest = StartRequest(),
        monitored: bool = False,
        tracking: Tracking = Tracking(),
        ema: WeightEMA | None = None,
    ) -> Run:
        """Print the plan, resume or claim `output_dir`, start the trackers (only after a
        successful resume, so a bad --resume leaves the folder as it was). `monitored`: the run
        exports its best epoch (early stopping), which tells a finished run's export apart.
        Every process calls it, after `accelerator.prepare` (a resume restores the prepared
        objects). `data_files` are the files the run's reader opens, by name
        (accel_common.data.named_files): their contents are part of the identity;
        `data_dir` (--data) names them in messages. `ema`: the EMA of the weights (training.ema,
        registered for checkpointing before this resume), which the exports then hold."""
        hold_output_dir(accelerator, output_dir)  # first: one live run per folder, for its life
        # read by the main process (once: the per-file digests are cached), the same for all
        found: list[Any] = [None, None]
        if accelerator.is_main_process and data_files is not None:
            cache = hash_cache_file(data_dir, data_hash_cache()) if data_dir is not None else None
            fingerprint, digests = files_fingerprint(data_files, cache)
            found = [fingerprint, digests if len(digests) <= LISTED_FILES else None]
        fingerprint, digests = broadcast_object_list(found)
        identity = run_identity(config.recipe, config.values, plan, config.adjustable, fingerprint)
        run = cls(accelerator, plan, config, output_dir, identity, schedule, digests)
        run.ema = ema or run.ema
        print_banner(
            accelerator,
            recipe=config.recipe,
            plan=plan,
            lr_line=schedule.description,
            total_steps=schedule.total_steps,
            extra={
                "compile": compile_line(bool(config.values.get("compile"))),
                **speed_lines(config.values),
            },
        )
        run._resume(start, data_dir, monitored)
        if run.finished_export is None:  # a finished run logs nothing more
            start_tracking(
                accelerator,
                project=tracking.project or f"accel-recipes-{config.recipe}",
                run_name=tracking.run_name,
                output_dir=run.output_dir,
                config={**config.values, **plan.as_dict()},
            )
        return run

    # ------------------------------------------------------------------ saves and exports

    def record(self) -> dict[str, Any]:
        """What every checkpoint records of the run: its id, identity, settings and data files'
        digests (a resume on changed data names the files)."""
        record = {"id": self.id, "identity": self.identity, "settings": self.config.as_json()}
        return record | ({"data_files": self.data_digests} if self.data_digests else {})

    def save(self, keep_last: int, process_state: dict[str, Any] | None = None) -> Path:
        """Save resumable state at the run's step (collective: every process calls it), with
        this process's own `process_state`, which a resume gives back as `resumed_state`."""
        self.last_saved = save_checkpoint(
            self.accelerator,
            self.output_dir,
            self.progress,
            plan=self.plan,
            keep_last=keep_last,
            run=self.record(),
            process_state=process_state,
        )
        return self.last_saved

    def export(self, model: torch.nn.Module, folder: Path, metrics: dict[str, float]) -> Path:
        """Export `model` at the run's step, its metadata recording the config (collective); with
        --ema-decay, its EMA (`ema.applied()`), and model.json's "ema" says so."""
        with self.ema.applied():
            return export_model(
                self.accelerator,
                model,
                folder,
                recipe=self.recipe,
                config=self.config.values,
                plan=self.plan,
                # the banner's LR line and step count: what --dry-run's are held to
                schedule={
                    "learning_rate": self.schedule.description,
                    "optimizer_steps": self.total_steps,
                },
                step=self.progress.step,
                metrics=metrics,
                derived=self.config.derived,
                ema=self.ema.record(),
            )

    def export_best(self, metrics: dict[str, float]) -> Path:
        """The best epoch's export becomes the run's export, with the run's final metrics."""
        best, final = self.output_dir / BEST_DIR, self.output_dir / "model"
        if self.accelerator.is_main_process:
            metadata = read_export_metadata(best)
            metadata["metrics"] = metrics
            weights = load_file(str(best / MODEL_FILE))
            write_export(weights, final, metadata, read_hf_layout(best), card=True)
        self.accelerator.wait_for_everyone()
        return final / MODEL_FILE

    # ------------------------------------------------------------------ resume or claim

    def _resume(self, start: StartRequest, data_dir: Path | None, monitored: bool) -> None:
        """Restore `start.resume`, or start fresh in an output folder that holds no other run."""
        resume, overwrite = start.resume, start.overwrite
        if overwrite and resume is not None:
            raise ConfigError("--overwrite starts a new run; it cannot go with --resume")
        if start.overwrite_later and resume is None:
            raise ConfigError(
                "--overwrite-later goes with --resume CHECKPOINT (an older step of the run); "
                "without --resume there is nothing to train on from"
            )
        restart = launcher_restart()
        if restart and (resume is None or list_checkpoints(self.output_dir)):
            # the first start claimed the folder (and moved an old run aside on --overwrite)
            say(self.accelerator, f"{restart}: continuing from the newest complete checkpoint")
            resume, overwrite = "latest", False
        path = resolve_resume(resume, self.output_dir)  # before a named step_N.tmp is removed
        unexpected = resume is not None or not overwrite  # --overwrite alone moves all aside
        remove_unfinished_saves(self.accelerator, self.output_dir, refuse_unexpected=unexpected)
        if path is None:
            self._claim_output_dir(resume, overwrite)
            self.id = broadcast_object_list([uuid.uuid4().hex[:12]])[0]
            values = self.config.values
            split_rng_streams(self.accelerator, values.get("seed", 0), values.get(ONE_STREAM))
            return
        check = RunCheck(
            self.plan, self.identity, self.config, self.total_steps, data_dir, self.data_digests
        )
        progress, run = load_checkpoint(
            self.accelerator, path, self.plan, accept=check, allow_unverified=start.allow_unverified
        )
        self.resumed_state = read_process_state(path, self.accelerator.process_index)
        self._make_way_for(path, progress.step, resume, start.overwrite_later)
        noted = self.config.adjustable - LAUNCH_SETTINGS
        saved = run.get("settings", run.get("identity", {}))
        changed = describe_differences(
            {k: saved[k] for k in noted if k in saved},
            {k: v for k, v in self.config.as_json().items() if k in noted and k in saved},
        )
        if changed:
            say(self.accelerator, f"resuming with changed settings: {changed}")
        self.id = run.get("id") or broadcast_object_list([uuid.uuid4().hex[:12]])[0]
        self.progress, self.last_saved = progress, path
        where = f"step {progress.step}, epoch {progress.epoch}, {progress.samples_in_epoch} samples"
        say(self.accelerator, f"resumed from {path}: {where} into it")
        self.finished_export = self._export_of_finished_run(progress, monitored)
        if self.finished_export is not None:
            say(
                self.accelerator,
                f"the run in {self.output_dir} already finished at step {progress.step}; its "
                f"export in {self.finished_export} is unchanged (to train on, resume with a "
                "larger --epochs or --max-steps)",
            )

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

    def _export_of_finished_run(self, progress: TrainProgress, monitored: bool) -> Path | None:
        """The export of a run that had finished when it was saved, if it is the one the loop's
        `finish` wrote: of its last step, or with a `monitor` the best epoch's with its final
        metrics. One missing or unreadable (a link, a file no safetensors) is exported again."""
        found = None
        finished = progress.step >= self.total_steps or progress.stopped
        folder = self.output_dir / "model"
        if finished and self.accelerator.is_main_process and intact_weights(folder / MODEL_FILE):
            try:
                metadata = read_export_metadata(folder) if (folder / META_FILE).is_file() else {}
            except CheckpointError:
                metadata = {}
            if monitored and progress.best_metrics:
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
        hold_output_dir(self.accelerator, self.output_dir)  # its lock moved aside with it
        say(self.accelerator, f"--overwrite: moved the earlier run in {self.output_dir} to {aside}")


@dataclass(frozen=True)
class RunCheck:
    """Whether a checkpoint is this run's, decided before anything is restored from it.

    Refused, with what differs: another recipe's, another global batch (the schedule and the
    resume position depend on it; the number of processes may change), a checkpoint past this
    run's last step (`total_steps`), another run's settings (`identity`: the settings that
    change the math), other data. A setting the checkpoint does not record (added to the recipe
    after it was saved) counts as its default: the run it continues ran that way.
    """

    plan: BatchPlan
    identity: dict[str, Any] | None = None
    config: RunConfig | None = None  # which settings may change, and their defaults
    total_steps: int | None = None
    data_dir: Path | None = None
    data_digests: dict[str, str] | None = None  # this run's data files' digests, by name

    def __call__(
        self, path: Path, progress: TrainProgress, saved_global: int, run: dict[str, Any]
    ) -> None:
        saved_recipe = (run.get("identity") or {}).get("recipe")
        recipe = (self.identity or {}).get("recipe")
        if saved_recipe and recipe and saved_recipe != recipe:  # before any setting
            raise CheckpointError(
                f"{path} is a checkpoint of the {saved_recipe} recipe, not of {recipe}; resume "
                f"it with recipes/train_{saved_recipe}.py, or give this {recipe} run its own "
                "--output-dir"
            )
        plan = self.plan
        if saved_global != plan.global_batch_size:
            raise CheckpointError(
                f"{path} was trained at global batch {saved_global}, this launch uses "
                f"{plan.global_batch_size} ({plan.describe()}); pass --bs {saved_global} to resume"
            )
        if self.total_steps is not None and progress.step > self.total_steps:
            raise CheckpointError(
                f"{path} is at optimizer step {progress.step}, past the {self.total_steps} steps "
                "this run has (--epochs / --max-steps); resume with the settings that checkpoint "
                "was trained with, or start a new run in another --output-dir"
            )
        if self.identity is None or "identity" not in run:
            return
        config = self.config or RunConfig("", {})
        saved = {k: v for k, v in run["identity"].items() if k not in config.adjustable}
        current = {k: v for k, v in self.identity.items() if k not in config.adjustable}
        added_since = object()  # a setting the checkpoint predates: it ran at the default
        defaults = config.defaults
        current = {
            k: v for k, v in current.items() if k in saved or defaults.get(k, added_since) != v
        }
        before, now = saved.pop(DATA_KEY, None), current.pop(DATA_KEY, None)
        digests = (run.get("data_files"), self.data_digests)
        refuse_other_data(path, (before, now), digests, self.data_dir)
        differences = describe_differences(saved, current, config.derived)
        if differences:
            raise CheckpointError(
                f"{path} belongs to another run (id {run.get('id')}): {differences}; resume with "
                "that run's settings, or start this one in another --output-dir (or pass "
                "--overwrite without --resume to move the old run aside)"
            )


def run_identity(
    recipe: str,
    config: dict[str, Any],
    plan: BatchPlan,
    adjustable: frozenset[str] = frozenset(),
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """What makes a checkpoint this run's: every setting but the `adjustable` ones, the recipe,
    the global batch and the content fingerprint of the files it reads, as they read back from
    JSON."""
    identity = {k: v for k, v in config.items() if k not in adjustable}
    identity |= {"recipe": recipe, "global_batch_size": plan.global_batch_size}
    if fingerprint is not None:
        identity[DATA_KEY] = fingerprint
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
