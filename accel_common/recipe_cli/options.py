"""The settings every recipe shares (`SharedSettings`), each declared once with `setting(...)`,
with the `--help` panel it is shown in (accel_common.recipe_cli.panels), and the groups they
travel in (batch request, LR settings, save policy); the methods that build a run's objects from
them are its base's (accel_common.recipe_cli.run_objects). accel_common.train_command makes them
flags.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from pathlib import Path

from accel_common.batch_lr.batching import BATCH_FLAG_HELP, BatchRequest
from accel_common.batch_lr.lr import Decay, LRScaling, LRSettings, parse_milestones
from accel_common.batch_lr.onecycle import Anneal, OneCycle
from accel_common.batch_lr.warmup import WarmupStyle
from accel_common.checkpoints.checkpoint_files import ALLOW_UNVERIFIED_HELP
from accel_common.errors import ConfigError
from accel_common.hardware.compilation import COMPILE_HELP
from accel_common.hardware.speed import (
    DDP_STATIC_GRAPH_HELP,
    FUSED_OPTIMIZER_HELP,
    MATMUL_PRECISION_HELP,
    MatmulPrecision,
)
from accel_common.monitoring.tracking import TRACKERS, parse_report_to
from accel_common.recipe_cli.panels import (
    BATCH_LR,
    CHECKPOINTS,
    DATA,
    LOGGING,
    PROCESSES,
    SCHEDULE,
    SPEED,
    TRAINING,
)
from accel_common.recipe_cli.run_objects import RunObjects
from accel_common.settings import Settings, setting
from accel_common.training.ema import EmaSettings, EmaWarmup
from accel_common.training.policy import OnNonFinite, SavePolicy
from accel_common.training.run import StartRequest


class MixedPrecision(str, Enum):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"


@dataclass
class SharedSettings(Settings, RunObjects):
    """The training settings every recipe shares (its own come in a second Settings class)."""

    data: Path | None = setting(
        None,
        "Data folder in the workload's original format. Omit it to generate (once) and train on "
        "a small built-in example. The data's contents are part of the run's identity.",
        adjustable=True,
        panel=DATA,
    )
    output_dir: Path = setting(
        Path("runs/recipe"),
        "Where checkpoints, logs and the exported model go.",
        adjustable=True,
        panel=DATA,
    )
    epochs: int = setting(
        10,
        "Passes over the training set; 0 = as many as --max-steps takes (training by "
        "iterations: the run's length is --max-steps).",
        min=0,
        adjustable=True,
        panel=TRAINING,
    )
    max_steps: int = setting(
        0,
        "Stop after this many optimizer steps (0 = run all epochs).",
        min=0,
        adjustable=True,
        panel=TRAINING,
    )
    bs: int | None = setting(
        None,
        BATCH_FLAG_HELP["bs"],
        min=1,
        adjustable=True,  # the global batch it gives is part of the identity, recorded apart
        panel=BATCH_LR,
    )
    per_device_bs: int | None = setting(
        None, BATCH_FLAG_HELP["per_device_bs"], min=1, adjustable=True, panel=BATCH_LR
    )
    max_per_device_bs: int | None = setting(
        None,
        BATCH_FLAG_HELP["max_per_device_bs"]
        + " 'auto': the largest batch that fits this device, from "
        "`accel-recipes plan --measure RECIPE` (runs/memory/RECIPE.json).",
        adjustable=True,
        cli_type=str | None,  # a number or 'auto', resolved before the run starts
        panel=BATCH_LR,
    )
    grad_accum: int = setting(
        1, BATCH_FLAG_HELP["grad_accum"], min=1, adjustable=True, panel=BATCH_LR
    )
    lr: float = setting(
        1e-3,
        "Peak learning rate at the reference global batch --ref-bs. May change on a resume (to "
        "rescue a run that diverged); the resume says so.",
        above=0,
        adjustable=True,
        panel=BATCH_LR,
    )
    ref_bs: int = setting(
        32,
        "Global batch that --lr was tuned for; --lr-scaling carries --lr from it to the actual "
        "global batch.",
        min=1,
        panel=BATCH_LR,
    )
    lr_scaling: LRScaling = setting(
        LRScaling.linear,
        "How the LR follows the global batch: none, linear (x batch ratio) or sqrt.",
        panel=BATCH_LR,
    )
    schedule: Decay = setting(
        Decay.cosine,
        "Decay after warmup: constant, cosine or linear (to --min-lr-ratio x the peak at "
        "--decay-steps or the last step; linear is HF's get_scheduler('linear'), the Trainer's "
        "default), exponential (x --gamma per step), step (x --gamma every --step-size), "
        "multistep (x --gamma at each of --milestones) or onecycle (torch's OneCycleLR: "
        "--pct-start, --div-factor, --final-div-factor, --anneal). LR of optimizer step k "
        "(from 0), with W warmup steps, D = W + hold, T = --decay-steps or the run's last step: "
        "peak x (s + (1 - s)(k + 1)/W) while k < W (k/W with --warmup-style hf), s = "
        "--warmup-start; then cosine: peak x (m + (1 - m)(1 + cos(pi min(1, (k - D)/(T - D))))"
        "/2); linear: peak x (m + (1 - m) max(0, 1 - (k - D)/(T - D))), m = --min-lr-ratio.",
        panel=SCHEDULE,
    )
    warmup_steps: int = setting(0, "Optimizer steps of linear warmup.", min=0, panel=SCHEDULE)
    warmup_epochs: int = setting(
        0,
        "Epochs of linear warmup instead, of the run's own optimizer steps per epoch.",
        min=0,
        panel=SCHEDULE,
    )
    warmup_start: float = setting(
        0.0,
        "Fraction of the peak LR that the warmup rises from, linearly (torch's LinearLR "
        "start_factor; 0 = from zero).",
        min=0.0,
        max=1.0,
        panel=SCHEDULE,
    )
    warmup_style: WarmupStyle = setting(
        WarmupStyle.one_step_ahead,
        "Which point of the warm-up's rise optimizer step k (from 0) trains at: one-step-ahead "
        "(s + (1 - s)(k + 1)/W: the last warm-up step at the peak) or hf (s + (1 - s)k/W: step "
        "0 at --warmup-start x peak, 0 by default, the peak at step W), as transformers' and "
        "diffusers' get_scheduler (the HF Trainer) and torch's LinearLR stepped from step 0. "
        "For porting an HF script; the same with --decay-per-epoch.",
        panel=SCHEDULE,
    )
    min_lr_ratio: float = setting(
        0.0,
        "Floor of cosine and linear decay, as a fraction of the peak LR (the scaled --lr): "
        "0.1 ends at 0.1 x peak.",
        min=0,
        max=1,
        panel=SCHEDULE,
    )
    decay_steps: int = setting(
        0,
        "Optimizer step where cosine, linear or exponential decay ends and the LR then holds "
        "its floor (nanoGPT's lr_decay_iters), apart from the run's length; 0 = the run's last "
        "step.",
        min=0,
        panel=SCHEDULE,
    )
    gamma: float = setting(
        1.0,
        "Factor of exponential decay per step, and of step and multistep decay at each change "
        "(torch's StepLR / MultiStepLR gamma, e.g. 0.1).",
        above=0,
        max=1,
        panel=SCHEDULE,
    )
    step_size: int = setting(
        0,
        "With --schedule step: multiply the LR by --gamma every N optimizer steps after the "
        "warmup (epochs with --decay-per-epoch), as torch's StepLR.",
        min=0,
        panel=SCHEDULE,
    )
    milestones: str = setting(
        "",
        "With --schedule multistep: comma-separated optimizer steps after the warmup (epochs "
        "with --decay-per-epoch) where the LR is multiplied by --gamma, as torch's MultiStepLR "
        "(e.g. 30,60,80).",
        panel=SCHEDULE,
    )
    hold_epochs: int = setting(
        0, "Epochs at the peak LR after the warmup, before the decay starts.", min=0, panel=SCHEDULE
    )
    decay_per_epoch: bool = setting(
        False,
        "Change the LR, warmup and decay, only at epoch boundaries, as a torch scheduler "
        "stepped after each epoch (else at every optimizer step).",
        panel=SCHEDULE,
    )
    pct_start: float = setting(
        0.3,
        "With --schedule onecycle: the fraction of the steps that the LR rises over "
        "(torch's OneCycleLR pct_start).",
        min=0.0,
        max=1.0,
        panel=SCHEDULE,
    )
    div_factor: float = setting(
        25.0,
        "With --schedule onecycle: the first step's LR is the peak / this (OneCycleLR div_factor).",
        above=0,
        panel=SCHEDULE,
    )
    final_div_factor: float = setting(
        1e4,
        "With --schedule onecycle: the last step's LR is the peak / --div-factor / this "
        "(OneCycleLR final_div_factor).",
        above=0,
        panel=SCHEDULE,
    )
    anneal: Anneal = setting(
        Anneal.cos,
        "With --schedule onecycle: rise and fall along a cosine (cos) or a line (linear), "
        "OneCycleLR's anneal_strategy.",
        panel=SCHEDULE,
    )
    cycle_momentum: bool = setting(
        False,
        "With --schedule onecycle: cycle the optimizer's momentum (Adam's beta1, SGD's momentum) "
        "from --max-momentum down to --base-momentum as the LR rises and back as it falls "
        "(OneCycleLR's cycle_momentum, torch's default); else the optimizer's own is kept.",
        panel=SCHEDULE,
    )
    base_momentum: float = setting(
        0.85,
        "With --cycle-momentum: the momentum at the peak LR.",
        min=0.0,
        max=1.0,
        panel=SCHEDULE,
    )
    max_momentum: float = setting(
        0.95,
        "With --cycle-momentum: the momentum at the first and last step.",
        min=0.0,
        max=1.0,
        panel=SCHEDULE,
    )
    weight_decay: float = setting(
        0.0,
        "Weight decay: decoupled in recipes on AdamW, L2 in those on Adam.",
        min=0,
        panel=TRAINING,
    )
    clip_grad: float = setting(
        0.0,
        "Clip the global gradient norm to this value (0 = off).",
        min=0,
        adjustable=True,
        panel=TRAINING,
    )
    on_nonfinite: OnNonFinite = setting(
        OnNonFinite.stop,
        "A NaN/inf loss or gradient on any process: stop (naming the step and the last good "
        "checkpoint) or skip that optimizer step on every process (counted and logged).",
        adjustable=True,
        panel=TRAINING,
    )
    ema_decay: float = setting(
        0.0,
        "Keep an exponential moving average (EMA) of the weights with this decay (e.g. 0.999; 0 "
        "= off): updated after each optimizer step and checkpointed; evaluation scores it and the "
        "export holds it (model.json: ema).",
        min=0.0,
        max=0.99999,
        panel=TRAINING,
    )
    ema_warmup: EmaWarmup = setting(
        EmaWarmup.none,
        "The EMA's decay over its first updates: none (--ema-decay from the initial weights, as "
        "pcdiff), ratio (min(decay, (1 + k)/(10 + k)) after update k's copy, diffusers' "
        "EMAModel default) or power (min(decay, 1 - (1 + k/--ema-inv-gamma)^-(--ema-power)), "
        "diffusers' use_ema_warmup).",
        panel=TRAINING,
    )
    ema_power: float = setting(
        2 / 3,
        "With --ema-warmup power: its power (diffusers' 2/3; 3/4 for shorter runs, as its DDPM "
        "example).",
        above=0.0,
        panel=TRAINING,
    )
    ema_inv_gamma: float = setting(
        1.0, "With --ema-warmup power: its inv_gamma (diffusers' 1).", above=0.0, panel=TRAINING
    )
    mixed_precision: MixedPrecision | None = setting(
        None, "no, fp16 or bf16; default: the accelerate config / launcher's choice.", panel=SPEED
    )
    seed: int = setting(
        0, "Seed for weights (alike on every process), shuffling and noise.", min=0, panel=TRAINING
    )
    sync_batchnorm: bool = setting(
        False,
        "Normalise every BatchNorm with the statistics of the global batch (all processes): N "
        "processes then train as one on N x the batch (torch's SyncBatchNorm on GPUs, "
        "accel_common.batch_lr.batchnorm elsewhere); without, each process's own.",
        panel=PROCESSES,
    )
    one_rng_stream: bool = setting(
        False,
        "One global RNG stream (dropout) on every process, as originals that seeded them alike; "
        "default: process k draws from --seed + k.",
        panel=PROCESSES,
    )
    deterministic: bool = setting(
        False,
        "Repeat bit for bit on the same hardware and software: deterministic kernels "
        "(torch.use_deterministic_algorithms), cuDNN without benchmarking, a fixed cuBLAS "
        "workspace; an op with no deterministic kernel stops the run, naming it. GPU runs are "
        "slower and otherwise differ in the last bits, which training amplifies. Part of the "
        "run's identity.",
        panel=SPEED,
    )
    compile: bool = setting(False, COMPILE_HELP, adjustable=True, panel=SPEED)
    matmul_precision: MatmulPrecision | None = setting(None, MATMUL_PRECISION_HELP, panel=SPEED)
    fused_optimizer: bool = setting(False, FUSED_OPTIMIZER_HELP, adjustable=True, panel=SPEED)
    ddp_static_graph: bool = setting(False, DDP_STATIC_GRAPH_HELP, adjustable=True, panel=SPEED)
    workers: int = setting(
        0, "DataLoader worker processes per training process.", min=0, adjustable=True, panel=DATA
    )
    log_every: int = setting(
        50,
        "Log loss, LR, grad norm and samples/s every N optimizer steps.",
        min=1,
        adjustable=True,
        panel=LOGGING,
    )
    save_every: int = setting(
        0,
        "Save resumable state every N optimizer steps (0 = only at the end).",
        min=0,
        adjustable=True,
        panel=CHECKPOINTS,
    )
    eval_every: int = setting(
        0,
        "Evaluate every N optimizer steps, counted from the run's start (a resumed run "
        "evaluates at the same steps), besides each epoch's end; 0 = only at epoch ends.",
        min=0,
        adjustable=True,
        panel=LOGGING,
    )
    keep_last: int = setting(
        2,
        "Resumable checkpoints to keep (older ones are deleted).",
        min=1,
        adjustable=True,
        panel=CHECKPOINTS,
    )
    resume: str | None = setting(
        None,
        "Resume from 'latest' (newest complete checkpoint in --output-dir, if any) or a "
        "checkpoint folder. The checkpoint must come from a run with the same settings (all but "
        "those that do not change what is trained: paths, cadence, workers, trackers, epochs and "
        "--max-steps, --lr and clipping) and the same data; a mismatch is refused, naming what "
        "differs.",
        adjustable=True,
        panel=CHECKPOINTS,
    )
    overwrite: bool = setting(
        False,
        "Start a new run in an --output-dir that holds another run's results, moving those "
        "aside to OUTPUT.replaced-<time> (nothing is deleted). Without it such a folder is "
        "refused: continue that run with --resume latest, or choose another --output-dir.",
        adjustable=True,
        panel=CHECKPOINTS,
    )
    overwrite_later: bool = setting(
        False,
        "With --resume of a checkpoint that is not the run's newest: move the run's later "
        "checkpoints and an export of a later step aside (to NAME.replaced-<time>; nothing is "
        "deleted) and train on from the older one. Without it such a resume is refused, since "
        "it would overwrite them.",
        adjustable=True,
        panel=CHECKPOINTS,
    )
    allow_unverified: bool = setting(
        False, ALLOW_UNVERIFIED_HELP, adjustable=True, panel=CHECKPOINTS
    )
    report_to: str = setting(
        "none",
        "Trackers besides metrics.jsonl, comma-separated: any that Accelerate supports ("
        + ", ".join(TRACKERS)
        + "), 'all' (every one installed) or none.",
        adjustable=True,
        panel=LOGGING,
    )
    wandb_project: str | None = setting(
        None, "Tracker project (default: accel-recipes-<recipe>).", adjustable=True, panel=LOGGING
    )
    wandb_name: str | None = setting(None, "Tracker run name.", adjustable=True, panel=LOGGING)
    cpu: bool = setting(
        False,
        "Train on the CPU even if an accelerator is present.",
        adjustable=True,
        panel=PROCESSES,
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
        panel=PROCESSES,
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
            warmup_epochs=self.warmup_epochs, warmup_style=self.warmup_style,
        )  # fmt: skip

    @property
    def ema_settings(self) -> EmaSettings:
        """--ema-decay and its warm-up (accel_common.training.ema)."""
        return EmaSettings(self.ema_decay, self.ema_warmup, self.ema_power, self.ema_inv_gamma)

    @property
    def save_policy(self) -> SavePolicy:
        """--log-every, --save-every, --keep-last, --eval-every."""
        return SavePolicy(self.log_every, self.save_every, self.keep_last, self.eval_every)

    @property
    def start_request(self) -> StartRequest:
        """--resume and the flags that go with it."""
        return StartRequest(**{f.name: getattr(self, f.name) for f in fields(StartRequest)})
