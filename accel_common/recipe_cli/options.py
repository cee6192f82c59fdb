"""The settings every recipe shares (`SharedSettings`), each declared once with `setting(...)`,
and the groups they travel in (batch request, LR settings, save policy) with the methods that
build a run's objects from them. accel_common.train_command makes them flags.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import KwargsHandler
from torch.utils.data import DataLoader, Dataset

import accel_common.hardware.accelerator
from accel_common.batch_lr.batching import BATCH_FLAG_HELP, BatchPlan, BatchRequest
from accel_common.batch_lr.batchnorm import sync_batchnorm
from accel_common.batch_lr.lr import (
    Decay,
    LRScaling,
    LRSchedule,
    LRSettings,
    make_lr_schedule,
    parse_milestones,
)
from accel_common.batch_lr.onecycle import Anneal, OneCycle
from accel_common.checkpoints.checkpoint_files import ALLOW_UNVERIFIED_HELP
from accel_common.data import loaders
from accel_common.deprecation import warn_deprecated
from accel_common.errors import ConfigError
from accel_common.hardware.compilation import COMPILE_HELP, requested_compilation
from accel_common.hardware.speed import (
    DDP_STATIC_GRAPH_HELP,
    FUSED_OPTIMIZER_HELP,
    MATMUL_PRECISION_HELP,
    MatmulPrecision,
    make_optimizer,
)
from accel_common.monitoring.tracking import TRACKERS, parse_report_to
from accel_common.settings import Settings, setting
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import EarlyStopping, LoopPolicy, OnNonFinite, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest, Tracking


class MixedPrecision(str, Enum):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"


@dataclass
class SharedSettings(Settings):
    """The training settings every recipe shares (its own come in a second Settings class)."""

    data: Path | None = setting(
        None,
        "Data folder in the workload's original format. Omit it to generate (once) and train on "
        "a small built-in example. The data's contents are part of the run's identity.",
        adjustable=True,
    )
    output_dir: Path = setting(
        Path("runs/recipe"), "Where checkpoints, logs and the exported model go.", adjustable=True
    )
    epochs: int = setting(
        10,
        "Passes over the training set; 0 = as many as --max-steps takes (training by "
        "iterations: the run's length is --max-steps).",
        min=0,
        adjustable=True,
    )
    max_steps: int = setting(
        0, "Stop after this many optimizer steps (0 = run all epochs).", min=0, adjustable=True
    )
    bs: int | None = setting(
        None,
        BATCH_FLAG_HELP["bs"],
        min=1,
        adjustable=True,  # the global batch it gives is part of the identity, recorded apart
    )
    per_device_bs: int | None = setting(
        None, BATCH_FLAG_HELP["per_device_bs"], min=1, adjustable=True
    )
    max_per_device_bs: int | None = setting(
        None,
        BATCH_FLAG_HELP["max_per_device_bs"]
        + " 'auto': the largest batch that fits this device, from "
        "`accel-recipes plan --measure RECIPE` (runs/memory/RECIPE.json).",
        adjustable=True,
        cli_type=str | None,  # a number or 'auto', resolved before the run starts
    )
    grad_accum: int = setting(1, BATCH_FLAG_HELP["grad_accum"], min=1, adjustable=True)
    lr: float = setting(
        1e-3,
        "Peak learning rate at the reference global batch --ref-bs. May change on a resume (to "
        "rescue a run that diverged); the resume says so.",
        above=0,
        adjustable=True,
    )
    ref_bs: int = setting(
        32,
        "Global batch that --lr was tuned for; --lr-scaling carries --lr from it to the actual "
        "global batch.",
        min=1,
    )
    lr_scaling: LRScaling = setting(
        LRScaling.linear,
        "How the LR follows the global batch: none, linear (x batch ratio) or sqrt.",
    )
    schedule: Decay = setting(
        Decay.cosine,
        "Decay after warmup: constant, cosine (to --min-lr-ratio x the peak at --decay-steps or "
        "the last step), exponential (x --gamma per step), step (x --gamma every --step-size), "
        "multistep (x --gamma at each of --milestones) or onecycle (torch's OneCycleLR: "
        "--pct-start, --div-factor, --final-div-factor, --anneal). LR of optimizer step k "
        "(from 0), with W warmup steps, D = W + hold, T = --decay-steps or the run's last step: "
        "peak x (s + (1 - s)(k + 1)/W) while k < W, s = --warmup-start; then cosine: peak x (m "
        "+ (1 - m)(1 + cos(pi min(1, (k - D)/(T - D))))/2), m = --min-lr-ratio.",
    )
    warmup_steps: int = setting(0, "Optimizer steps of linear warmup.", min=0)
    warmup_epochs: int = setting(
        0, "Epochs of linear warmup instead, of the run's own optimizer steps per epoch.", min=0
    )
    warmup_start: float = setting(
        0.0,
        "Fraction of the peak LR that the warmup rises from, linearly (torch's LinearLR "
        "start_factor; 0 = from zero).",
        min=0.0,
        max=1.0,
    )
    min_lr_ratio: float = setting(
        0.0,
        "Floor of cosine decay, as a fraction of the peak LR (the scaled --lr): "
        "0.1 ends at 0.1 x peak.",
        min=0,
        max=1,
    )
    decay_steps: int = setting(
        0,
        "Optimizer step where cosine or exponential decay ends and the LR then holds its floor "
        "(nanoGPT's lr_decay_iters), apart from the run's length; 0 = the run's last step.",
        min=0,
    )
    gamma: float = setting(
        1.0,
        "Factor of exponential decay per step, and of step and multistep decay at each change "
        "(torch's StepLR / MultiStepLR gamma, e.g. 0.1).",
        above=0,
        max=1,
    )
    step_size: int = setting(
        0,
        "With --schedule step: multiply the LR by --gamma every N optimizer steps after the "
        "warmup (epochs with --decay-per-epoch), as torch's StepLR.",
        min=0,
    )
    milestones: str = setting(
        "",
        "With --schedule multistep: comma-separated optimizer steps after the warmup (epochs "
        "with --decay-per-epoch) where the LR is multiplied by --gamma, as torch's MultiStepLR "
        "(e.g. 30,60,80).",
    )
    hold_epochs: int = setting(
        0, "Epochs at the peak LR after the warmup, before the decay starts.", min=0
    )
    decay_per_epoch: bool = setting(
        False,
        "Change the LR, warmup and decay, only at epoch boundaries, as a torch scheduler "
        "stepped after each epoch (else at every optimizer step).",
    )
    pct_start: float = setting(
        0.3,
        "With --schedule onecycle: the fraction of the steps that the LR rises over "
        "(torch's OneCycleLR pct_start).",
        min=0.0,
        max=1.0,
    )
    div_factor: float = setting(
        25.0,
        "With --schedule onecycle: the first step's LR is the peak / this (OneCycleLR div_factor).",
        above=0,
    )
    final_div_factor: float = setting(
        1e4,
        "With --schedule onecycle: the last step's LR is the peak / --div-factor / this "
        "(OneCycleLR final_div_factor).",
        above=0,
    )
    anneal: Anneal = setting(
        Anneal.cos,
        "With --schedule onecycle: rise and fall along a cosine (cos) or a line (linear), "
        "OneCycleLR's anneal_strategy.",
    )
    cycle_momentum: bool = setting(
        False,
        "With --schedule onecycle: cycle the optimizer's momentum (Adam's beta1, SGD's momentum) "
        "from --max-momentum down to --base-momentum as the LR rises and back as it falls "
        "(OneCycleLR's cycle_momentum, torch's default); else the optimizer's own is kept.",
    )
    base_momentum: float = setting(
        0.85, "With --cycle-momentum: the momentum at the peak LR.", min=0.0, max=1.0
    )
    max_momentum: float = setting(
        0.95, "With --cycle-momentum: the momentum at the first and last step.", min=0.0, max=1.0
    )
    weight_decay: float = setting(
        0.0, "Weight decay: decoupled in recipes on AdamW, L2 in those on Adam.", min=0
    )
    clip_grad: float = setting(
        0.0, "Clip the global gradient norm to this value (0 = off).", min=0, adjustable=True
    )
    on_nonfinite: OnNonFinite = setting(
        OnNonFinite.stop,
        "A NaN/inf loss or gradient on any process: stop (naming the step and the last good "
        "checkpoint) or skip that optimizer step on every process (counted and logged).",
        adjustable=True,
    )
    mixed_precision: MixedPrecision | None = setting(
        None, "no, fp16 or bf16; default: the accelerate config / launcher's choice."
    )
    seed: int = setting(0, "Seed for weights (alike on every process), shuffling and noise.", min=0)
    sync_batchnorm: bool = setting(
        False,
        "Normalise every BatchNorm with the statistics of the global batch (all processes): N "
        "processes then train as one on N x the batch (torch's SyncBatchNorm on GPUs, "
        "accel_common.batch_lr.batchnorm elsewhere); without, each process's own.",
    )
    one_rng_stream: bool = setting(
        False,
        "One global RNG stream (dropout) on every process, as originals that seeded them alike; "
        "default: process k draws from --seed + k.",
    )
    deterministic: bool = setting(
        False,
        "Repeat bit for bit on the same hardware and software: deterministic kernels "
        "(torch.use_deterministic_algorithms), cuDNN without benchmarking, a fixed cuBLAS "
        "workspace; an op with no deterministic kernel stops the run, naming it. GPU runs are "
        "slower and otherwise differ in the last bits, which training amplifies. Part of the "
        "run's identity.",
    )
    compile: bool = setting(False, COMPILE_HELP, adjustable=True)
    matmul_precision: MatmulPrecision | None = setting(None, MATMUL_PRECISION_HELP)
    fused_optimizer: bool = setting(False, FUSED_OPTIMIZER_HELP, adjustable=True)
    ddp_static_graph: bool = setting(False, DDP_STATIC_GRAPH_HELP, adjustable=True)
    workers: int = setting(
        0, "DataLoader worker processes per training process.", min=0, adjustable=True
    )
    log_every: int = setting(
        50, "Log loss, LR, grad norm and samples/s every N optimizer steps.", min=1, adjustable=True
    )
    save_every: int = setting(
        0,
        "Save resumable state every N optimizer steps (0 = only at the end).",
        min=0,
        adjustable=True,
    )
    eval_every: int = setting(
        0,
        "Evaluate every N optimizer steps, counted from the run's start (a resumed run "
        "evaluates at the same steps), besides each epoch's end; 0 = only at epoch ends.",
        min=0,
        adjustable=True,
    )
    keep_last: int = setting(
        2, "Resumable checkpoints to keep (older ones are deleted).", min=1, adjustable=True
    )
    resume: str | None = setting(
        None,
        "Resume from 'latest' (newest complete checkpoint in --output-dir, if any) or a "
        "checkpoint folder. The checkpoint must come from a run with the same settings (all but "
        "those that do not change what is trained: paths, cadence, workers, trackers, epochs and "
        "--max-steps, --lr and clipping) and the same data; a mismatch is refused, naming what "
        "differs.",
        adjustable=True,
    )
    overwrite: bool = setting(
        False,
        "Start a new run in an --output-dir that holds another run's results, moving those "
        "aside to OUTPUT.replaced-<time> (nothing is deleted). Without it such a folder is "
        "refused: continue that run with --resume latest, or choose another --output-dir.",
        adjustable=True,
    )
    overwrite_later: bool = setting(
        False,
        "With --resume of a checkpoint that is not the run's newest: move the run's later "
        "checkpoints and an export of a later step aside (to NAME.replaced-<time>; nothing is "
        "deleted) and train on from the older one. Without it such a resume is refused, since "
        "it would overwrite them.",
        adjustable=True,
    )
    allow_unverified: bool = setting(False, ALLOW_UNVERIFIED_HELP, adjustable=True)
    report_to: str = setting(
        "none",
        "Trackers besides metrics.jsonl, comma-separated: any that Accelerate supports ("
        + ", ".join(TRACKERS)
        + "), 'all' (every one installed) or none.",
        adjustable=True,
    )
    wandb_project: str | None = setting(
        None, "Tracker project (default: accel-recipes-<recipe>).", adjustable=True
    )
    wandb_name: str | None = setting(None, "Tracker run name.", adjustable=True)
    cpu: bool = setting(
        False, "Train on the CPU even if an accelerator is present.", adjustable=True
    )
    dist_timeout: int = setting(
        0,
        "Seconds a collective (gradient all-reduce, barrier) waits for the other processes "
        "before this process fails with an error instead of hanging, on gloo (CPU) and NCCL "
        "alike. 0 = torch's default: 30 min on gloo, 10 min on NCCL. Keep it above the longest "
        "time one process works alone: the main process's data preparation, saving or "
        "evaluation.",
        min=0,
        adjustable=True,
    )

    def validate(self) -> None:
        super().validate()
        if self.epochs == 0 and self.max_steps == 0:
            raise ConfigError(
                "--epochs 0 trains by iterations, until --max-steps: give --max-steps N "
                "(optimizer steps), or a number of epochs"
            )
        parse_report_to(self.report_to)
        self.lr_settings  # noqa: B018 (refuses a schedule that lacks its --step-size, ...)

    # The flags in groups, each built here once and passed whole to the library function that
    # takes it (a script with its own flags builds the groups itself).

    @property
    def batch_request(self) -> BatchRequest:
        """--bs / --per-device-bs, --grad-accum, --max-per-device-bs."""
        return BatchRequest(self.bs, self.per_device_bs, self.grad_accum, self.max_per_device_bs)

    @property
    def lr_settings(self) -> LRSettings:
        """--lr, --ref-bs, --lr-scaling, --schedule, the warmup and the decay's shape."""
        return LRSettings(
            self.lr, self.ref_bs, self.lr_scaling, self.schedule, self.warmup_steps,
            self.min_lr_ratio, self.gamma, self.hold_epochs, self.decay_per_epoch,
            warmup_start=self.warmup_start, decay_steps=self.decay_steps,
            step_size=self.step_size, milestones=parse_milestones(self.milestones),
            onecycle=OneCycle(
                self.pct_start, self.div_factor, self.final_div_factor, self.anneal,
                self.cycle_momentum, self.base_momentum, self.max_momentum,
            ),
            warmup_epochs=self.warmup_epochs,
        )  # fmt: skip

    @property
    def save_policy(self) -> SavePolicy:
        """--log-every, --save-every, --keep-last, --eval-every."""
        return SavePolicy(self.log_every, self.save_every, self.keep_last, self.eval_every)

    @property
    def start_request(self) -> StartRequest:
        """--resume and the flags that go with it."""
        return StartRequest(**{f.name: getattr(self, f.name) for f in fields(StartRequest)})

    def make_accelerator(
        self, kwargs_handlers: Iterable[KwargsHandler] = ()
    ) -> tuple[Accelerator, BatchPlan]:
        """The Accelerator and batch plan these flags ask for (accelerator.make_accelerator)."""
        return accel_common.hardware.accelerator.make_accelerator(
            output_dir=self.output_dir, batch=self.batch_request,
            mixed_precision=self.mixed_precision.value if self.mixed_precision else None,
            cpu=self.cpu, report_to=self.report_to, dist_timeout=self.dist_timeout,
            seed=self.seed, deterministic=self.deterministic, kwargs_handlers=kwargs_handlers,
            matmul_precision=self.matmul_precision.value if self.matmul_precision else None,
            ddp_static_graph=self.ddp_static_graph,
        )  # fmt: skip

    def make_optimizer(
        self, optimizer_class: type[torch.optim.Optimizer], params: Iterable[Any], **kwargs: Any
    ) -> torch.optim.Optimizer:
        """`optimizer_class(params, **kwargs)`, fused with --fused-optimizer (speed.make_optimizer:
        a fused kernel torch lacks is refused, naming the flag)."""
        return make_optimizer(optimizer_class, params, self.fused_optimizer, **kwargs)

    def adapt_model(self, model: torch.nn.Module) -> None:
        """What the launch asks of `model`, in place: --sync-batchnorm's BatchNorms over the
        global batch (accel_common.batch_lr.batchnorm), then --compile (or the launch config's
        dynamo backend: accel_common.hardware.compilation). Call it after any copy of the model is
        made (an EMA copies the compiled function too, which would run the original), before
        accelerator.prepare."""
        if self.sync_batchnorm:
            sync_batchnorm(model, PartialState().device)
        compilation = requested_compilation(self.compile)
        if compilation is not None:
            compilation.apply(model)

    def compile_model(self, model: torch.nn.Module) -> None:
        """adapt_model's name before 0.2.0, kept so that older recipes run (DeprecationWarning)."""
        warn_deprecated("SharedSettings.compile_model", "SharedSettings.adapt_model")
        self.adapt_model(model)

    def make_train_loader(
        self,
        dataset: Dataset,
        plan: BatchPlan,
        collate_fn: Callable | None = None,
        costs: Sequence[float] | None = None,
        replacement: bool = False,
    ) -> DataLoader:
        """The shuffled, drop-last training loader (data.loaders.make_train_loader); with `costs`
        (one per item), each step's items balanced over processes by cost; with `replacement`,
        each epoch's items drawn with replacement (iteration-sampled training)."""
        return loaders.make_train_loader(
            dataset, plan.per_device_batch_size, seed=self.seed, workers=self.workers,
            collate_fn=collate_fn, costs=costs, plan=plan, replacement=replacement,
        )  # fmt: skip

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
            self.lr_settings,
            steps_per_epoch=steps_per_epoch,
            epochs=self.epochs,
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
        data_files: Mapping[str, Path],
        settings: Settings | None = None,
        derived: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        monitor: str | None = None,
        patience: int = 0,
        min_epochs: int = 0,
        min_delta: float = 0.0,
    ) -> TrainLoop:
        """The run's TrainLoop (loop.TrainLoop). `data_files` are every file the run's data
        reader opens, by name (accel_common.data.named_files): their contents are the
        data's part of the run's identity. `settings` are the workload's own, `derived`
        what the run computed from its data that single-device commands need too (a target's
        mean, a vocabulary size); all of it, with every setting here, is stored in the trackers,
        the checkpoints and the export, and is the run's identity but for the adjustable
        settings. `monitor` and `patience` keep the best epoch's model and stop early, not before
        epoch `min_epochs` + 1; an epoch resets the patience only when better by more than
        `min_delta`."""
        own = [settings] if settings is not None else []
        run_config = RunConfig(
            recipe,
            {**self.as_config(), **merged(own, "as_config"), **(derived or {}), **(config or {})},
            adjustable=frozenset(self.adjustable().union(*(s.adjustable() for s in own))),
            derived=frozenset(derived or {}),
            defaults={**self.default_config(), **merged(own, "default_config")},
        )
        stopping = EarlyStopping(monitor, patience, min_epochs, min_delta)
        policy = LoopPolicy(self.save_policy, self.clip_grad, self.on_nonfinite, stopping)
        policy.check(accelerator)  # before the run claims its folder
        run = Run.open(
            accelerator,
            plan,
            schedule,
            run_config,
            output_dir=self.output_dir,
            data_dir=self.data or loaders.example_data_dir(recipe),
            data_files=data_files,
            start=self.start_request,
            monitored=bool(monitor),
            tracking=Tracking(self.wandb_project, self.wandb_name),
        )
        return TrainLoop(accelerator, plan, loader, schedule, run, policy)


def merged(settings: list[Settings], method: str) -> dict[str, Any]:
    """One dict of every Settings object's `method()` (as_config, default_config)."""
    return {k: v for s in settings for k, v in getattr(s, method)().items()}
