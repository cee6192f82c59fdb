"""Run set-up that every recipe needs in the same form: Accelerator, LR plan, data, resume, CLI."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import typer
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    KwargsHandler,
    set_seed,
)
from torch.utils.data import DataLoader, Dataset

from accel_common.batching import BatchPlan, plan_batch, total_optimizer_steps
from accel_common.checkpoint import (
    TrainProgress,
    export_model,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from accel_common.console import print_banner, say
from accel_common.data.files import EpochShuffleSampler
from accel_common.errors import ConfigError, DataError, exit_on_error
from accel_common.lr import Schedule, build_scheduler, scale_lr
from accel_common.options import TrainArgs
from accel_common.tracking import StepLogger, start_tracking, trackers_for

EXAMPLE_DATA_ROOT = Path("data/example")


def make_accelerator(
    args: TrainArgs, kwargs_handlers: Iterable[KwargsHandler] = ()
) -> tuple[Accelerator, BatchPlan]:
    """Build the Accelerator and the batch plan for this launch's world size.

    Two settings differ from Accelerate's defaults, both so that the math does not depend on the
    number of processes: the scheduler is stepped by the recipe once per optimizer step (see
    accel_common.lr), and accumulation windows run across epoch ends instead of flushing a short
    window at the end of each epoch, so every optimizer step sees exactly the global batch.

    The process group is created here, by the first PartialState, so its settings (--dist-timeout,
    a recipe's InitProcessGroupKwargs) go to it directly: Accelerate ignores them once the group
    exists, and InitProcessGroupKwargs.to_kwargs() drops a timeout equal to its own default (600 s).
    """
    if args.dist_timeout < 0:
        raise ConfigError(f"--dist-timeout {args.dist_timeout}: give seconds, or 0 for the default")
    cpu = args.cpu or not torch.accelerator.is_available()
    kwargs_handlers = list(kwargs_handlers)
    init = next((h for h in kwargs_handlers if isinstance(h, InitProcessGroupKwargs)), None)
    group_kwargs = init.to_kwargs() if init else {}
    if args.dist_timeout:
        group_kwargs["timeout"] = timedelta(seconds=args.dist_timeout)
    world = PartialState(cpu=cpu, **group_kwargs).num_processes
    plan = plan_batch(
        world,
        global_batch_size=args.bs,
        per_device_batch_size=args.per_device_bs,
        grad_accum_steps=args.grad_accum,
        max_per_device_batch_size=args.max_per_device_bs,
        warn_small=False,  # the banner warns, once, on the main process
    )
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=args.mixed_precision.value if args.mixed_precision else None,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=plan.grad_accum_steps, sync_with_dataloader=False
        ),
        step_scheduler_with_optimizer=False,
        log_with=trackers_for(args.report_to, args.output_dir),
        project_dir=str(args.output_dir),
        kwargs_handlers=kwargs_handlers,
    )
    require_requested_sharding(accelerator)
    set_seed(args.seed)  # same initial weights on every process
    return accelerator, plan


def require_requested_sharding(accelerator: Accelerator) -> None:
    """Refuse a launch whose FSDP/DeepSpeed config Accelerate silently dropped.

    Accelerate turns FSDP and DeepSpeed on only with a GPU (or another accelerator); on the CPU it
    trains plain data-parallel without a word, holding the whole model on every process.
    """
    for flag, kind in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED")):
        if os.environ.get(flag, "").lower() == "true" and accelerator.distributed_type != kind:
            raise ConfigError(
                f"the launch config asks for {kind}, but Accelerate enables it only on GPUs (or "
                f"other accelerators) and would run this launch as "
                f"{accelerator.distributed_type.value} instead, with the whole model on every "
                "process; launch on GPUs, or use accelerate_configs/cpu_2proc.yaml on the CPU"
            )


def make_train_loader(dataset: Dataset, plan: BatchPlan, args: TrainArgs) -> DataLoader:
    """The training DataLoader every recipe needs, before `prepare`.

    - batch = the plan's per-device batch; drop_last, so every optimizer step sees exactly the
      global batch;
    - the shuffle order depends only on (seed, epoch): 1 or N processes see the same global
      batches, and a resumed run the same order;
    - its own generator: creating a loader iterator draws a seed, and drawing it from the global
      RNG would shift dropout masks after a resume (which restores that RNG).
    """
    return DataLoader(
        dataset,
        batch_size=plan.per_device_batch_size,
        sampler=EpochShuffleSampler(len(dataset), args.seed),
        drop_last=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed),
    )


def make_lr_schedule(
    accelerator: Accelerator,
    args: TrainArgs,
    plan: BatchPlan,
    optimizer: torch.optim.Optimizer,
    micro_batches_per_epoch: int,
) -> tuple[torch.optim.lr_scheduler.LambdaLR, int, str]:
    """Count the run's optimizer steps, scale --lr to the global batch, build the schedule.

    A parameter group with an `lr_scale` entry gets that multiple of the peak LR. The scheduler
    is registered for checkpointing (not prepared: see accel_common.lr). Returns
    it, the number of optimizer steps, and a banner line saying where the peak LR came from.
    """
    total_steps = total_optimizer_steps(micro_batches_per_epoch, args.epochs, plan.grad_accum_steps)
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    peak = scale_lr(args.lr, args.ref_bs, plan.global_batch_size, args.lr_scaling)
    for group in optimizer.param_groups:
        group["lr"] = peak * group.get("lr_scale", 1.0)  # a group may ask for a multiple
    schedule = Schedule(
        total_steps=total_steps,
        warmup_steps=min(args.warmup_steps, total_steps),  # a short (--max-steps) run still works
        decay=args.schedule,
        min_lr_ratio=args.min_lr_ratio,
        gamma=args.gamma,
    )
    line = (
        f"peak {peak:.4g} (--lr {args.lr:g} at --ref-bs {args.ref_bs}, {args.lr_scaling.value} "
        f"scaling to global batch {plan.global_batch_size}); {schedule.warmup_steps} warmup steps, "
        f"then {args.schedule.value}"
    )
    scheduler = build_scheduler(optimizer, schedule)
    accelerator.register_for_checkpointing(scheduler)
    return scheduler, total_steps, line


def start_run(
    accelerator: Accelerator,
    args: TrainArgs,
    plan: BatchPlan,
    *,
    recipe: str,
    config: dict[str, Any],
    lr_line: str,
    total_steps: int,
) -> tuple[TrainProgress, StepLogger]:
    """Print the plan, restore --resume state, start the trackers, and open the step logger.

    Call it after `prepare` (resume loads into the prepared objects). Trackers start only after
    a successful resume, so a bad --resume leaves the output folder as it was.
    """
    print_banner(accelerator, recipe=recipe, plan=plan, lr_line=lr_line, total_steps=total_steps)
    progress = resume_if_asked(accelerator, args, plan)
    start_tracking(
        accelerator,
        project=args.wandb_project or f"accel-recipes-{recipe}",
        run_name=args.wandb_name,
        output_dir=args.output_dir,
        config={**config, **plan.as_dict()},
    )
    log = StepLogger(
        accelerator,
        total_steps=total_steps,
        initial_step=progress.step,
        log_every=args.log_every,
        global_batch_size=plan.global_batch_size,
        desc=recipe,
    )
    return progress, log


def finish_run(
    accelerator: Accelerator,
    args: TrainArgs,
    plan: BatchPlan,
    progress: TrainProgress,
    model: torch.nn.Module,
    *,
    recipe: str,
    config: dict[str, Any],
    metrics: dict[str, float],
) -> Path:
    """Save the final resumable state, export the model with its metrics, close the trackers."""
    save_checkpoint(accelerator, args.output_dir, progress, plan=plan, keep_last=args.keep_last)
    path = export_model(
        accelerator,
        model,
        args.output_dir / "model",
        recipe=recipe,
        config=config,
        plan=plan,
        step=progress.step,
        metrics=metrics,
    )
    say(accelerator, f"exported {path}")
    accelerator.end_training()
    return path


def resume_if_asked(accelerator: Accelerator, args: TrainArgs, plan: BatchPlan) -> TrainProgress:
    """Restore the state named by --resume (after `prepare`), or start from step 0."""
    path = resolve_resume(args.resume, args.output_dir)
    if path is None:
        if args.resume == "latest":
            say(accelerator, f"--resume latest: no checkpoint in {args.output_dir}; starting")
        return TrainProgress()
    progress = load_checkpoint(accelerator, path, plan)
    say(
        accelerator,
        f"resumed from {path}: step {progress.step}, epoch {progress.epoch}, "
        f"{progress.samples_in_epoch} samples into it",
    )
    return progress


def resolve_data(
    accelerator: Accelerator, workload: str, data: Path | None, make_example: Callable[[Path], Any]
) -> Path:
    """The user's --data folder, or a small example written once by the main process."""
    if data is not None:
        if not data.is_dir():
            raise DataError(f"--data {data}: no such folder")
        return data
    target = EXAMPLE_DATA_ROOT / workload
    with accelerator.main_process_first():
        if accelerator.is_main_process and not target.exists():
            say(accelerator, f"no --data given: writing example {workload} data to {target}")
            tmp = target.with_name(target.name + ".tmp")
            make_example(tmp)
            tmp.rename(target)
    return target


def grad_norm(
    accelerator: Accelerator, model: torch.nn.Module, clip: float, measure: bool
) -> torch.Tensor | None:
    """Clip to `clip` if set; otherwise compute the norm only when it will be logged.

    Only on micro-batches that end an accumulation window: clipping a partial sum of gradients
    would change the update.
    """
    if not accelerator.sync_gradients:
        return None
    if clip > 0:
        return accelerator.clip_grad_norm_(model.parameters(), clip)
    if measure:
        return accelerator.clip_grad_norm_(model.parameters(), float("inf"))
    return None


def run_recipe(train: Callable[..., Any], **subcommands: Callable[..., Any]) -> None:
    """`python recipe.py [flags]` trains; `python recipe.py NAME [flags]` runs a subcommand.

    Training stays the default command, so `accelerate launch recipe.py --bs 64` works unchanged.
    """
    argv = sys.argv[1:]
    name = argv[0] if argv and argv[0] in subcommands else None
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    chosen = subcommands[name] if name else train
    if name is None and subcommands:
        doc = (train.__doc__ or "").strip()
        train.__doc__ = (
            doc
            + "\n\nOther commands: "
            + ", ".join(f"`{sys.argv[0]} {sub} --help`" for sub in subcommands)
        )
    app.command()(exit_on_error(chosen))
    prog = Path(sys.argv[0]).name + (f" {name}" if name else "")
    app(args=argv[1:] if name else argv, prog_name=prog)
