"""Learning-rate scaling and schedules that count optimizer steps, not processes.

Scaling: an LR tuned at a reference global batch (`--ref-bs`) is carried to the actual global
batch by a rule: `none` keeps it, `linear` multiplies by the batch ratio (Goyal et al.), `sqrt` by
its square root (gentler, often better for Adam).

Schedules: warmup, an optional hold at the peak, then decay; the multiplier is a pure function of
the optimizer step (one step = one update after gradient accumulation). With peak P, warmup W
steps (--warmup-steps, or --warmup-epochs x the run's optimizer steps per epoch) rising from the
fraction s (--warmup-start), hold H steps, decay start D = W + H, horizon T
(--decay-steps, else the run's last step) and floor m (--min-lr-ratio, a fraction of P), the LR
of optimizer step k (from 0) is

    k < W:        P x (s + (1 - s) x (k + 1) / W)      (k / W with --warmup-style hf: warmup.py)
    D <= k:       constant     P
                  cosine       P x (m + (1 - m) x (1 + cos(pi x min(1, (k - D) / (T - D)))) / 2)
                  linear       P x (m + (1 - m) x max(0, 1 - (k - D) / (T - D)))
                  exponential  P x gamma ^ min(k - D, T - D)
                  step         P x gamma ^ ((k - D) // step_size)           (torch's StepLR)
                  multistep    P x gamma ^ (milestones <= k - D, counted)   (torch's MultiStepLR)

and P between. linear's line is computed as (T - k) / (T - D) of whole steps: at m = 0 and
D = W, transformers' and diffusers' "linear" (get_linear_schedule_with_warmup) bit for bit.
`onecycle` is torch's OneCycleLR instead, its own shape from step 0 to T
(accel_common.batch_lr.onecycle: --pct-start, --div-factor, --final-div-factor, --anneal, and
--cycle-momentum, which sets the optimizer's momentum at every step too); it takes no
warmup, hold or floor of the above (refused), nor --decay-per-epoch. With --decay-per-epoch,
k - D counts whole epochs' steps (the LR changes at epoch boundaries), and step_size and the
milestones count epochs. Accelerate's prepared
scheduler, by default, calls `step()` once per process on every optimizer step, so that a
schedule written in single-process steps runs `num_processes` times faster. Recipes instead build
their `Accelerator` with `step_scheduler_with_optimizer=False` and call `scheduler.step()` once per
optimizer step (when `accelerator.sync_gradients` is true): the LR at step k is then the same on 1
process or 64, and checkpoint resume restores it exactly.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from enum import Enum

import torch
from accelerate import Accelerator

from accel_common.batch_lr.batching import BatchPlan, total_optimizer_steps
from accel_common.batch_lr.onecycle import OneCycle, require_momentum, set_momentum
from accel_common.batch_lr.warmup import WarmupStyle, refuse_without_warmup, warmup_multiplier
from accel_common.errors import ConfigError


class LRScaling(str, Enum):
    none = "none"
    linear = "linear"
    sqrt = "sqrt"


class Decay(str, Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"
    exponential = "exponential"
    onecycle = "onecycle"
    step = "step"
    multistep = "multistep"


def scale_lr(ref_lr: float, ref_batch_size: int, global_batch_size: int, rule: LRScaling) -> float:
    """LR for `global_batch_size`, given one tuned at `ref_batch_size`."""
    if not ref_lr > 0 or not math.isfinite(ref_lr):
        raise ConfigError(f"--lr must be a positive number, got {ref_lr}")
    if ref_batch_size < 1:
        raise ConfigError(f"--ref-bs must be a positive integer, got {ref_batch_size}")
    ratio = global_batch_size / ref_batch_size
    rule = LRScaling(rule)
    if rule is LRScaling.linear:
        return ref_lr * ratio
    if rule is LRScaling.sqrt:
        return ref_lr * math.sqrt(ratio)
    return ref_lr


def parse_milestones(text: str) -> tuple[int, ...]:
    """--milestones '30,60,80' -> (30, 60, 80): whole numbers above 0, increasing."""
    try:
        values = tuple(int(part) for part in text.split(",")) if text.strip() else ()
    except ValueError:
        values = (0,)
    if any(v < 1 for v in values) or any(a >= b for a, b in itertools.pairwise(values)):
        raise ConfigError(
            f"--milestones {text}: give increasing whole numbers above 0, comma-separated "
            "(e.g. 30,60,80)"
        )
    return values


@dataclass(frozen=True)
class LRSettings:
    """The LR as asked for (--lr at --ref-bs, --lr-scaling, --schedule and its shape): the peak
    and the banner's line for a global batch. The run and its --dry-run describe it alike."""

    lr: float
    ref_bs: int
    scaling: LRScaling = LRScaling.linear
    decay: Decay = Decay.cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    gamma: float = 1.0
    hold_epochs: int = 0
    decay_per_epoch: bool = False
    warmup_start: float = 0.0
    decay_steps: int = 0
    step_size: int = 0
    milestones: tuple[int, ...] = ()
    onecycle: OneCycle = field(default_factory=OneCycle)
    warmup_epochs: int = 0
    warmup_style: WarmupStyle = WarmupStyle.one_step_ahead

    def __post_init__(self) -> None:
        decay = Decay(self.decay)
        if self.warmup_steps and self.warmup_epochs:
            raise ConfigError(
                f"--warmup-steps {self.warmup_steps} and --warmup-epochs {self.warmup_epochs} "
                "both set the warmup's length: give one (--warmup-epochs 0 to count steps, or "
                "--warmup-steps 0 to count epochs of the run's own optimizer steps)"
            )
        if decay is Decay.onecycle:
            self.refuse_with_onecycle()
        refuse_without_warmup(self.warmup_style, self.warmup_steps, self.warmup_epochs)
        if decay is Decay.step and self.step_size < 1:
            raise ConfigError(
                "--schedule step needs --step-size N: multiply the LR by --gamma every N "
                "optimizer steps (epochs with --decay-per-epoch)"
            )
        if decay is Decay.multistep and not self.milestones:
            raise ConfigError(
                "--schedule multistep needs --milestones a,b,c: multiply the LR by --gamma at "
                "each (optimizer steps after the warmup; epochs with --decay-per-epoch)"
            )
        unused = [
            (name, used_by)
            for name, value, used_by in (
                ("--step-size", self.step_size, Decay.step),
                ("--milestones", self.milestones, Decay.multistep),
                *((name, True, Decay.onecycle) for name in self.onecycle.changed()),
            )
            if value and decay is not used_by
        ]
        if unused:
            name, used_by = unused[0]
            raise ConfigError(
                f"{name} shapes another schedule than --schedule {decay.value}: drop it, "
                f"or choose --schedule {used_by.value}"
            )
        if self.decay_steps and decay in (Decay.step, Decay.multistep, Decay.constant):
            raise ConfigError(
                f"--decay-steps {self.decay_steps} ends a cosine, linear, onecycle or "
                f"exponential decay; --schedule {decay.value} has none to end: drop --decay-steps"
            )

    def refuse_with_onecycle(self) -> None:
        """onecycle is OneCycleLR's own shape: the flags of the warmup, hold and floor of the
        other schedules would change it into something torch's is not; name the first one."""
        for flag, value, default in (
            ("--warmup-steps", self.warmup_steps, 0),
            ("--warmup-epochs", self.warmup_epochs, 0),
            ("--warmup-start", self.warmup_start, 0.0),
            ("--hold-epochs", self.hold_epochs, 0),
            ("--min-lr-ratio", self.min_lr_ratio, 0.0),
            ("--decay-per-epoch", self.decay_per_epoch, False),
            ("--warmup-style", WarmupStyle(self.warmup_style), WarmupStyle.one_step_ahead),
        ):
            if value != default:
                shown = value.value if isinstance(value, WarmupStyle) else f"{value:g}"
                given = flag if value is True else f"{flag} {shown}"
                fix = (
                    f"--no-{flag[2:]}"
                    if value is True
                    else f"{flag} {getattr(default, 'value', default)}"
                )
                raise ConfigError(
                    f"--schedule onecycle takes no {given}: it rises over --pct-start of the "
                    "run from peak / --div-factor to the peak, then falls to peak / --div-factor "
                    f"/ --final-div-factor at every optimizer step, as torch's OneCycleLR; give "
                    f"{fix}, or another --schedule"
                )

    def peak(self, global_batch_size: int) -> float:
        return scale_lr(self.lr, self.ref_bs, global_batch_size, self.scaling)

    def run_warmup(
        self, total_steps: int, steps_per_epoch: int = 0, grad_accum_steps: int = 1
    ) -> int | None:
        """The warmup the run uses, in optimizer steps: --warmup-steps, or --warmup-epochs x the
        run's own optimizer steps per epoch (`steps_per_epoch` micro-batches per process over
        `grad_accum_steps`; 0 where the data is unread, as in a --dry-run: then None, unless
        the run is no longer than the warmup's epochs, which have an optimizer step each at
        least), cut to the run's length, so a short (--max-steps) run still works. The run and
        its --dry-run both cut it here."""
        if not self.warmup_epochs:
            return min(self.warmup_steps, total_steps)
        if not steps_per_epoch:
            return total_steps if total_steps <= self.warmup_epochs else None
        return min(self.warmup_epochs * steps_per_epoch // grad_accum_steps, total_steps)

    def describe(self, global_batch_size: int, warmup_steps: int | None = None) -> str:
        """The banner's LR line: the peak, where it came from, and the schedule's shape
        (`warmup_steps`: as the run's length cut them, else as asked) down to its floor."""
        steps = self.warmup_steps if warmup_steps is None else warmup_steps
        warmup = f"{steps} warmup steps"
        if self.warmup_epochs:  # its steps are known once the data is read (not in a dry run)
            counted = "x the data's optimizer steps per epoch"
            if warmup_steps is not None:
                counted = f"{warmup_steps} optimizer steps"
            warmup = f"{self.warmup_epochs} warmup epochs ({counted})"
            steps = self.warmup_epochs if warmup_steps is None else warmup_steps
        if self.warmup_start and steps:
            warmup += f" from {self.warmup_start:g} x peak"
        if WarmupStyle(self.warmup_style) is WarmupStyle.hf and steps:
            warmup += " (hf style: step 0 at its start, the peak at the first step after it)"
        if self.hold_epochs:
            warmup += f", {self.hold_epochs} epochs at the peak"
        peak = self.peak(global_batch_size)
        shape = self.describe_decay(peak)  # onecycle's own rise included
        if Decay(self.decay) is not Decay.onecycle:
            shape = f"{warmup}, then {shape}"
        return (
            f"peak {peak:.4g} (--lr {self.lr:g} at --ref-bs {self.ref_bs}, "
            f"{LRScaling(self.scaling).value} scaling to global batch {global_batch_size}); "
            f"{shape}"
        )

    def describe_decay(self, peak: float) -> str:
        """The decay after the warmup and hold, with its floor: 'cosine to 1e-05 (0.01 x peak)
        at the last step'."""
        decay = Decay(self.decay)
        unit = "epoch" if self.decay_per_epoch else "step"
        name = decay.value + (" per epoch" if self.decay_per_epoch else "")
        end = f"at step {self.decay_steps}, then held" if self.decay_steps else "at the last step"
        if decay is Decay.onecycle:
            return (
                f"onecycle {self.onecycle.describe(peak)} {end}{self.onecycle.describe_momentum()}"
            )
        if decay in (Decay.cosine, Decay.linear):
            floor = peak * self.min_lr_ratio
            return f"{name} to {floor:.4g} ({self.min_lr_ratio:g} x peak) {end}"
        if decay is Decay.exponential:
            return f"{name}, x {self.gamma:g} per step until {end.removeprefix('at ')}"
        if decay is Decay.step:
            return f"{name}, x {self.gamma:g} every {self.step_size} {unit}s"
        if decay is Decay.multistep:
            at = ", ".join(map(str, self.milestones))
            return f"{name}, x {self.gamma:g} at {unit}s {at} after the warmup"
        return name


@dataclass(frozen=True)
class Schedule:
    """Warmup, hold, then decay, as a multiplier of the peak LR at each optimizer step (the
    formula is in the module docstring).

    `hold_steps` keep the peak LR after the warmup before the decay starts. `decay_steps` > 0 is
    the optimizer step where cosine, linear or exponential decay ends (then holds; nanoGPT's
    lr_decay_iters), else the run's last step. `decay_every` > 1 changes the LR, warmup
    included, only every that many steps (one epoch's: a torch scheduler stepped after each
    epoch, as cricketmodel's CosineAnnealingLR and pcdiff's LinearLR warmup: in epoch e the
    warmup is e epochs along); `step_size` and `milestones` then count such periods.
    `min_lr_ratio` is the floor that cosine and linear decay to (e.g. 0.1 means 0.1 x peak).
    `gamma` is the factor of exponential decay per step, and of step and multistep decay at each
    change (1.0 keeps the LR constant after warmup). `warmup_start` is the fraction of the peak
    that warmup rises from (torch's LinearLR start_factor; 0 by default), and `warmup_style`
    which point of that rise step k trains at (accel_common.batch_lr.warmup). `onecycle` is
    torch's OneCycleLR, shaped by `cycle` over `decay_steps` or the run (then held at its floor);
    the warmup, hold and floor above do not apply to it (LRSettings refuses them).
    """

    total_steps: int
    warmup_steps: int = 0
    decay: Decay = Decay.constant
    min_lr_ratio: float = 0.0
    gamma: float = 1.0
    hold_steps: int = 0
    decay_every: int = 1
    warmup_start: float = 0.0
    decay_steps: int = 0
    step_size: int = 1
    milestones: tuple[int, ...] = ()
    cycle: OneCycle = field(default_factory=OneCycle)
    warmup_style: WarmupStyle = WarmupStyle.one_step_ahead

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(
                f"a schedule needs at least one optimizer step, got {self.total_steps} (is the "
                "training set smaller than one global batch?)"
            )
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ConfigError(
                f"--warmup-steps must be between 0 and the run's {self.total_steps} optimizer "
                f"steps, got {self.warmup_steps}"
            )
        if not 0 <= self.hold_steps <= self.total_steps - self.warmup_steps:
            raise ConfigError(
                f"--hold-epochs: its {self.hold_steps} steps at the peak LR and the "
                f"{self.warmup_steps} warmup steps exceed the run's {self.total_steps} optimizer "
                "steps; hold fewer epochs or train more"
            )
        if self.decay_steps and self.decay_steps <= self.warmup_steps + self.hold_steps:
            raise ConfigError(
                f"--decay-steps {self.decay_steps}: the decay ends at that optimizer step, so it "
                f"must come after the {self.warmup_steps} warmup and {self.hold_steps} hold "
                "steps; give a later step"
            )
        if self.decay_every < 1 or self.step_size < 1:
            raise ConfigError(
                f"the decay's period must be 1 step or more, got {self.decay_every} and "
                f"--step-size {self.step_size}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"--gamma must be in (0, 1], got {self.gamma}")
        if not 0.0 <= self.warmup_start <= 1.0:
            raise ConfigError(
                f"the warmup's start factor must be in [0, 1], got {self.warmup_start}"
            )

    def multiplier(self, step: int) -> float:
        """Fraction of the peak LR used for optimizer step `step` (0-based)."""
        decay = Decay(self.decay)
        if decay is Decay.onecycle:
            return self.cycle.multiplier(step, self.decay_steps or self.total_steps)
        warmup = self.warmup_steps
        if step < warmup:
            return warmup_multiplier(
                step, warmup, self.warmup_start, self.decay_every, self.warmup_style
            )
        start = warmup + self.hold_steps
        if decay is Decay.constant or step < start:
            return 1.0
        periods = (step - start) // self.decay_every  # whole periods (steps or epochs) of decay
        if decay is Decay.step:
            return self.gamma ** (periods // self.step_size)
        if decay is Decay.multistep:
            return self.gamma ** bisect.bisect_right(self.milestones, periods)
        since = periods * self.decay_every
        span = max(1, (self.decay_steps or self.total_steps) - start)
        if decay is Decay.exponential:
            return self.gamma ** min(since, span)
        if decay is Decay.linear:  # (T - k) / (T - W) in integers, as transformers' "linear"
            line = max(0, span - since) / span
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * line
        progress = min(1.0, since / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def momentum(self, step: int) -> float | None:
        """The optimizer's momentum for optimizer step `step` where the schedule cycles it
        (onecycle with --cycle-momentum), else None: the optimizer's own is left alone."""
        if Decay(self.decay) is not Decay.onecycle or not self.cycle.cycle_momentum:
            return None
        return self.cycle.momentum(step, self.decay_steps or self.total_steps)


class ScheduledLR(torch.optim.lr_scheduler.LambdaLR):
    """A LambdaLR at the schedule's multiplier that, where the schedule cycles the momentum,
    sets it too at every step (the constructor's included) from the same step counter, as
    OneCycleLR's cycle_momentum. Its state_dict holds numbers only (the last step, base LRs: no
    function, no schedule), so checkpoints load weights-only and resume with the schedule set;
    the momentum in use travels in the optimizer's state_dict (its param groups' betas)."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Schedule) -> None:
        # Plain functions, not bound methods: LambdaLR keeps them out of its state_dict.
        def multiplier(step: int) -> float:
            return schedule.multiplier(step)

        self.momentum = schedule.momentum
        if schedule.momentum(0) is not None:
            require_momentum(optimizer)
        super().__init__(optimizer, multiplier)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        momentum = self.momentum(self.last_epoch)
        if momentum is not None:
            set_momentum(self.optimizer, momentum)

    def state_dict(self) -> dict:
        state = super().state_dict()
        del state["momentum"]
        return state


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: Schedule) -> ScheduledLR:
    """The run's scheduler of `schedule`; step it once per optimizer step (module docstring)."""
    return ScheduledLR(optimizer, schedule)


@dataclass(frozen=True)
class LRSchedule:
    """The run's scheduler, its length in optimizer steps, and where the peak LR came from."""

    scheduler: ScheduledLR
    total_steps: int
    description: str


def make_lr_schedule(
    accelerator: Accelerator,
    optimizer: torch.optim.Optimizer,
    plan: BatchPlan,
    settings: LRSettings,
    *,
    steps_per_epoch: int,
    epochs: int,
    max_steps: int = 0,
) -> LRSchedule:
    """Count the run's optimizer steps, scale the LR to the global batch, build the schedule.

    `steps_per_epoch` is the prepared loader's length (micro-batches per process per epoch);
    `max_steps` > 0 caps the run, and with `epochs` 0 is its length, over as many epochs as it
    takes. `settings.hold_epochs` keep the peak LR after the warmup;
    `settings.decay_per_epoch` changes the LR (warmup and decay) only at epoch boundaries. A
    parameter group with an `lr_scale` entry gets that multiple of the peak LR. The scheduler is
    registered for checkpointing, not prepared (see the module docstring for why).
    """
    passes = max(epochs, 1)  # --epochs 0: as many as --max-steps takes
    total_steps = total_optimizer_steps(steps_per_epoch, passes, plan.grad_accum_steps)
    if steps_per_epoch < 1 or (epochs and total_steps < 1):
        usable = steps_per_epoch * plan.per_device_batch_size * plan.num_processes
        raise ConfigError(
            f"the training split is smaller than one global batch: its {passes} epoch(s) fill "
            f"{usable * passes} of the {plan.global_batch_size} samples of one optimizer step "
            f"({plan.describe()}); pass a smaller --bs (at most the training split's size), or "
            "use more data"
        )
    if not epochs:
        total_steps = max_steps
    elif max_steps:
        total_steps = min(total_steps, max_steps)
    warmup_steps = settings.run_warmup(total_steps, steps_per_epoch, plan.grad_accum_steps) or 0
    epoch_steps = max(1, steps_per_epoch // plan.grad_accum_steps)  # optimizer steps per epoch
    hold_steps = min(
        settings.hold_epochs * steps_per_epoch // plan.grad_accum_steps, total_steps - warmup_steps
    )
    peak = settings.peak(plan.global_batch_size)
    for group in optimizer.param_groups:
        group["lr"] = peak * group.get("lr_scale", 1.0)
    schedule = Schedule(
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        decay=settings.decay,
        min_lr_ratio=settings.min_lr_ratio,
        gamma=settings.gamma,
        hold_steps=hold_steps,
        decay_every=epoch_steps if settings.decay_per_epoch else 1,
        warmup_start=settings.warmup_start,
        decay_steps=settings.decay_steps,
        step_size=max(1, settings.step_size),
        milestones=settings.milestones,
        cycle=settings.onecycle,
        warmup_style=settings.warmup_style,
    )
    description = settings.describe(plan.global_batch_size, schedule.warmup_steps)
    scheduler = build_scheduler(optimizer, schedule)
    accelerator.register_for_checkpointing(scheduler)
    return LRSchedule(scheduler, total_steps, description)
