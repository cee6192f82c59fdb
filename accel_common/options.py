"""The flags every recipe shares, declared once and added to each recipe's Typer command.

A recipe writes only its workload's flags in its own signature and receives the shared ones as a
`TrainArgs`:

    @train_options(lr=2e-4, ref_bs=8, bs=8)      # this workload's defaults
    def train(args: TrainArgs, hidden: int = typer.Option(64, help="...")) -> None: ...

`--help` lists both. Flag names follow the original codebases (`--bs`, `--lr`, `--epochs`,
`--workers`, `--wandb-project`, ...).
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import typer
from accelerate import Accelerator
from accelerate.utils import KwargsHandler
from torch.utils.data import DataLoader, Dataset

from accel_common import runtime
from accel_common.batching import BatchPlan
from accel_common.errors import ConfigError
from accel_common.loop import OnNonFinite, TrainLoop
from accel_common.lr import Decay, LRScaling, LRSchedule, make_lr_schedule
from accel_common.memory import memory_flags, parse_max_per_device_bs
from accel_common.tracking import ReportTo


class MixedPrecision(str, Enum):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"


@dataclass
class TrainArgs:
    """Shared training flags; see HELP for what each one means."""

    data: Path | None = None
    output_dir: Path = Path("runs/recipe")
    epochs: int = 10
    max_steps: int = 0
    bs: int | None = None
    per_device_bs: int | None = None
    max_per_device_bs: int | None = None
    grad_accum: int = 1
    lr: float = 1e-3
    ref_bs: int = 32
    lr_scaling: LRScaling = LRScaling.linear
    schedule: Decay = Decay.cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    gamma: float = 1.0
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    on_nonfinite: OnNonFinite = OnNonFinite.stop
    mixed_precision: MixedPrecision | None = None
    seed: int = 0
    workers: int = 0
    log_every: int = 50
    save_every: int = 0
    keep_last: int = 2
    resume: str | None = None
    overwrite: bool = False
    report_to: ReportTo = ReportTo.none
    wandb_project: str | None = None
    wandb_name: str | None = None
    cpu: bool = False
    dist_timeout: int = 0

    def validate(self) -> None:
        """Refuse values that cannot work, naming the flag, before anything starts."""
        checks = [
            ("lr", self.lr > 0 and math.isfinite(self.lr), "a positive number"),
            ("weight_decay", self.weight_decay >= 0, "0 or more"),
            ("clip_grad", self.clip_grad >= 0, "0 (off) or more"),
            ("seed", self.seed >= 0, "0 or more"),
            ("workers", self.workers >= 0, "0 or more"),
            ("epochs", self.epochs >= 1, "1 or more"),
            ("max_steps", self.max_steps >= 0, "0 (no cap) or more"),
            ("save_every", self.save_every >= 0, "0 (only at the end) or more"),
            ("keep_last", self.keep_last >= 1, "1 or more"),
            ("log_every", self.log_every >= 1, "1 or more"),
            ("warmup_steps", self.warmup_steps >= 0, "0 or more"),
            ("grad_accum", self.grad_accum >= 1, "1 or more"),
            ("ref_bs", self.ref_bs >= 1, "1 or more"),
            ("dist_timeout", self.dist_timeout >= 0, "seconds, or 0 for the default"),
        ]
        for name, ok, expected in checks:
            # `not ok` is also true for NaN, which fails every comparison
            if not ok:
                raise ConfigError(f"{_flag(name)} {getattr(self, name)}: give {expected}")

    def as_config(self) -> dict[str, Any]:
        return {k: v.value if hasattr(v, "value") else v for k, v in asdict(self).items()}

    # Each method below hands these flags, by name, to one library function that takes plain
    # values: read it to see which flag goes where, or call the function yourself.

    def make_accelerator(
        self, kwargs_handlers: Iterable[KwargsHandler] = ()
    ) -> tuple[Accelerator, BatchPlan]:
        """The Accelerator and batch plan these flags ask for (runtime.make_accelerator)."""
        return runtime.make_accelerator(
            output_dir=self.output_dir,
            global_batch_size=self.bs,
            per_device_batch_size=self.per_device_bs,
            grad_accum_steps=self.grad_accum,
            max_per_device_batch_size=self.max_per_device_bs,
            mixed_precision=self.mixed_precision.value if self.mixed_precision else None,
            cpu=self.cpu,
            report_to=self.report_to,
            dist_timeout=self.dist_timeout,
            seed=self.seed,
            kwargs_handlers=kwargs_handlers,
        )

    def make_train_loader(
        self, dataset: Dataset, plan: BatchPlan, collate_fn: Callable | None = None
    ) -> DataLoader:
        """The shuffled, drop-last training loader (runtime.make_train_loader)."""
        return runtime.make_train_loader(
            dataset,
            plan.per_device_batch_size,
            seed=self.seed,
            workers=self.workers,
            collate_fn=collate_fn,
        )

    def make_lr_schedule(
        self,
        accelerator: Accelerator,
        optimizer: torch.optim.Optimizer,
        plan: BatchPlan,
        steps_per_epoch: int,
    ) -> LRSchedule:
        """--lr scaled to the global batch, warmup and decay (lr.make_lr_schedule)."""
        return make_lr_schedule(
            accelerator,
            optimizer,
            plan,
            steps_per_epoch=steps_per_epoch,
            epochs=self.epochs,
            lr=self.lr,
            ref_bs=self.ref_bs,
            scaling=self.lr_scaling,
            decay=self.schedule,
            warmup_steps=self.warmup_steps,
            min_lr_ratio=self.min_lr_ratio,
            gamma=self.gamma,
            max_steps=self.max_steps,
        )

    def make_loop(
        self,
        accelerator: Accelerator,
        plan: BatchPlan,
        loader: DataLoader,
        schedule: LRSchedule,
        *,
        recipe: str,
        config: dict[str, Any],
        monitor: str | None = None,
        patience: int = 0,
    ) -> TrainLoop:
        """The run's TrainLoop (loop.TrainLoop); `config` is the workload's own settings, stored
        with every flag here in the trackers and the export; `monitor` and `patience` keep the
        best epoch's model and stop early (see TrainLoop)."""
        return TrainLoop(
            accelerator,
            plan,
            loader,
            schedule,
            recipe=recipe,
            config={**self.as_config(), **config},
            output_dir=self.output_dir,
            resume=self.resume,
            overwrite=self.overwrite,
            data_dir=self.data or runtime.example_data_dir(recipe),
            log_every=self.log_every,
            save_every=self.save_every,
            keep_last=self.keep_last,
            clip_grad=self.clip_grad,
            tracker_project=self.wandb_project,
            tracker_run_name=self.wandb_name,
            on_nonfinite=self.on_nonfinite,
            monitor=monitor,
            patience=patience,
        )


HELP = {
    "data": "Data folder in the workload's original format. Omit it to generate (once) and train "
    "on a small built-in example.",
    "output_dir": "Where checkpoints, logs and the exported model go.",
    "epochs": "Passes over the training set.",
    "max_steps": "Stop after this many optimizer steps (0 = run all epochs).",
    "bs": "GLOBAL batch per optimizer step, split over all processes (and accumulation steps). "
    "Give this or --per-device-bs, not both.",
    "per_device_bs": "Batch on EACH device per forward pass; the global batch grows with the "
    "number of processes. Give this or --bs, not both.",
    "max_per_device_bs": "Memory cap on the per-device batch: anything above it becomes gradient "
    "accumulation, keeping the global batch. 'auto': the largest batch that fits this device, "
    "from `accel-recipes plan --measure RECIPE` (runs/memory/RECIPE.json).",
    "grad_accum": "Micro-batches accumulated per optimizer step.",
    "lr": "Peak learning rate at the reference global batch --ref-bs.",
    "ref_bs": "Global batch that --lr was tuned for; --lr-scaling carries --lr from it to the "
    "actual global batch.",
    "lr_scaling": "How the LR follows the global batch: none, linear (x batch ratio) or sqrt.",
    "schedule": "Decay after warmup: constant, cosine (to --min-lr-ratio), exponential (--gamma "
    "per step) or onecycle.",
    "warmup_steps": "Optimizer steps of linear warmup.",
    "min_lr_ratio": "Floor of cosine decay, as a fraction of the peak LR.",
    "gamma": "Per-step factor of exponential decay.",
    "weight_decay": "Weight decay: decoupled in recipes on AdamW, L2 in those on Adam.",
    "clip_grad": "Clip the global gradient norm to this value (0 = off).",
    "on_nonfinite": "A NaN/inf loss or gradient on any process: stop (naming the step and the "
    "last good checkpoint) or skip that optimizer step on every process (counted and logged).",
    "mixed_precision": "no, fp16 or bf16; default: the accelerate config / launcher's choice.",
    "seed": "Seed for weights, shuffling and noise; the same on every process.",
    "workers": "DataLoader worker processes per training process.",
    "log_every": "Log loss, LR, grad norm and samples/s every N optimizer steps.",
    "save_every": "Save resumable state every N optimizer steps (0 = only at the end).",
    "keep_last": "Resumable checkpoints to keep (older ones are deleted).",
    "resume": "Resume from 'latest' (newest complete checkpoint in --output-dir, if any) or a "
    "checkpoint folder. The checkpoint must come from a run with the same settings that change "
    "the math (model, LR, schedule, epochs, seed, precision, global batch, data); a mismatch is "
    "refused, naming what differs.",
    "overwrite": "Start a new run in an --output-dir that holds another run's results, moving "
    "those aside to OUTPUT.replaced-<time> (nothing is deleted). Without it such a folder is "
    "refused: continue that run with --resume latest, or choose another --output-dir.",
    "report_to": "Trackers besides metrics.jsonl: none, wandb, tensorboard or all.",
    "wandb_project": "wandb project (default: accel-recipes-<recipe>).",
    "wandb_name": "wandb run name.",
    "cpu": "Train on the CPU even if an accelerator is present.",
    "dist_timeout": "Seconds a collective (gradient all-reduce, barrier) waits for the other "
    "processes before this process fails with an error instead of hanging, on gloo (CPU) and NCCL "
    "alike. 0 = torch's default: 30 min on gloo, 10 min on NCCL. Keep it above the longest time "
    "one process works alone: the main process's data preparation, saving or evaluation.",
}


# flags whose command-line form differs from the value TrainArgs holds: the memory cap may be
# 'auto', which becomes a number before the run starts
CLI_TYPES: dict[str, Any] = {"max_per_device_bs": str | None}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def model_option(recipe: str) -> Any:
    """`--model DIR` of a recipe's single-device commands (predict, score, ...): an exported
    model folder, by default the one training writes."""
    return typer.Option(
        Path(f"runs/{recipe}/model"), "--model", help="Exported model folder (train's output)."
    )


def train_options(
    *,
    default_bs: int | None = None,
    default_per_device_bs: int | None = None,
    aliases: dict[str, list[str]] | None = None,
    **defaults: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the TrainArgs flags (with this recipe's `defaults`) to a Typer command.

    The batch default is given apart (`default_bs` = global, or `default_per_device_bs`) because it
    applies only when the user passes neither --bs nor --per-device-bs. `aliases` adds the flag
    names an original codebase used, e.g. {"data": ["--path"], "epochs": ["--niter"]}.
    """
    aliases = aliases or {}
    hints = typing.get_type_hints(TrainArgs)
    unknown = (set(defaults) | set(aliases)) - set(HELP) | ({"bs", "per_device_bs"} & set(defaults))
    if unknown:
        raise TypeError(f"train_options got unknown defaults: {sorted(unknown)}")
    if (default_bs is None) == (default_per_device_bs is None):
        raise TypeError("give train_options exactly one of default_bs, default_per_device_bs")
    default_note = (
        f" Default when neither is given: --bs {default_bs}."
        if default_bs is not None
        else f" Default when neither is given: --per-device-bs {default_per_device_bs}."
    )
    helps = {
        **HELP,
        "bs": HELP["bs"] + default_note,
        "per_device_bs": HELP["per_device_bs"] + default_note,
    }

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        shared = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=typer.Option(
                    defaults.get(f.name, f.default),
                    _flag(f.name),
                    *aliases.get(f.name, []),
                    help=helps[f.name],
                ),
                annotation=CLI_TYPES.get(f.name, hints[f.name]),
            )
            for f in fields(TrainArgs)
        ]
        names = [f.name for f in fields(TrainArgs)]
        recipe = Path(inspect.getfile(fn)).stem.removeprefix("train_")

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            shared = {name: kwargs.pop(name) for name in names}
            shared["max_per_device_bs"] = parse_max_per_device_bs(
                shared["max_per_device_bs"],
                recipe,
                memory_flags(kwargs, shared["mixed_precision"]),
            )
            args = TrainArgs(**shared)
            if args.bs is None and args.per_device_bs is None:
                args.bs, args.per_device_bs = default_bs, default_per_device_bs
            args.validate()
            return fn(args, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
        command.default_batch = (default_bs, default_per_device_bs)  # type: ignore[attr-defined]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # type: ignore[attr-defined]
        return command

    return decorate
