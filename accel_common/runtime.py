"""Run set-up that every recipe needs in the same form: Accelerator, LR plan, data, resume, CLI."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import typer
from accelerate import Accelerator, PartialState
from accelerate.utils import GradientAccumulationPlugin, KwargsHandler, set_seed

from accel_common.batching import BatchPlan, plan_batch
from accel_common.checkpoint import TrainProgress, load_checkpoint, resolve_resume
from accel_common.errors import DataError, exit_on_error
from accel_common.lr import Schedule, build_scheduler, scale_lr
from accel_common.options import TrainArgs
from accel_common.tracking import trackers_for

EXAMPLE_DATA_ROOT = Path("data/example")


def make_accelerator(
    args: TrainArgs, kwargs_handlers: Iterable[KwargsHandler] = ()
) -> tuple[Accelerator, BatchPlan]:
    """Build the Accelerator and the batch plan for this launch's world size.

    Two settings differ from Accelerate's defaults, both so that the math does not depend on the
    number of processes: the scheduler is stepped by the recipe once per optimizer step (see
    accel_common.lr), and accumulation windows run across epoch ends instead of flushing a short
    window at the end of each epoch, so every optimizer step sees exactly the global batch.
    """
    cpu = args.cpu or not torch.accelerator.is_available()
    world = PartialState(cpu=cpu).num_processes
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
        kwargs_handlers=list(kwargs_handlers),
    )
    set_seed(args.seed)  # same initial weights on every process
    return accelerator, plan


def make_lr_schedule(
    args: TrainArgs, plan: BatchPlan, optimizer: torch.optim.Optimizer, total_steps: int
) -> tuple[torch.optim.lr_scheduler.LambdaLR, str]:
    """Scale --lr to the global batch, set it on the optimizer, and build the schedule.

    Returns the scheduler and a line for the banner explaining where the peak LR came from.
    """
    peak = scale_lr(args.lr, args.ref_bs, plan.global_batch_size, args.lr_scaling)
    for group in optimizer.param_groups:
        group["lr"] = peak
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
    return build_scheduler(optimizer, schedule), line


def resume_if_asked(accelerator: Accelerator, args: TrainArgs, plan: BatchPlan) -> TrainProgress:
    """Restore the state named by --resume (after `prepare`), or start from step 0."""
    path = resolve_resume(args.resume, args.output_dir)
    if path is None:
        if args.resume == "latest":
            accelerator.print(f"--resume latest: no checkpoint in {args.output_dir}; starting")
        return TrainProgress()
    progress = load_checkpoint(accelerator, path, plan)
    accelerator.print(
        f"resumed from {path}: step {progress.step}, epoch {progress.epoch}, "
        f"{progress.samples_in_epoch} samples into it"
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
            accelerator.print(f"no --data given: writing example {workload} data to {target}")
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
