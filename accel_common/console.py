"""What the main process shows: a start banner with the plan, one progress bar, epoch metrics."""

from __future__ import annotations

import sys
from typing import Any

from accelerate import Accelerator
from tqdm.auto import tqdm

from accel_common.batch_lr.batching import SMALL_PER_DEVICE_BATCH, BatchPlan


def say(accelerator: Accelerator, message: str) -> None:
    """Print once per job. `accelerator.print` prints on every node's local main process, so a
    2-node job would say everything twice."""
    if accelerator.is_main_process:
        print(message, flush=True)


def print_names(text: str) -> None:
    """Print `text` with the file names in it as their own bytes: a name that is not UTF-8
    (b"\\xff.png", which Python holds as a surrogate) stops print() with UnicodeEncodeError."""
    data = f"{text}\n".encode(sys.stdout.encoding or "utf-8", "surrogateescape")
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def print_banner(
    accelerator: Accelerator,
    *,
    recipe: str,
    plan: BatchPlan,
    lr_line: str,
    total_steps: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """The plan users otherwise reconstruct from logs: world, device, precision, batch, LR."""
    if not accelerator.is_main_process:
        return
    rows = {
        "recipe": recipe,
        "world size": f"{accelerator.num_processes} process(es), this one on {accelerator.device}",
        "distributed": str(accelerator.distributed_type.value),
        "mixed precision": accelerator.mixed_precision,
        "batch": plan.describe(),
        "learning rate": lr_line,
        "optimizer steps": str(total_steps),
        **{k: str(v) for k, v in (extra or {}).items()},
    }
    width = max(map(len, rows))
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows.items()]
    if plan.per_device_batch_size < SMALL_PER_DEVICE_BATCH:
        lines.append(
            f"  warning: per-device batch {plan.per_device_batch_size} gives noisy gradients and an"
            " idle device; raise --bs or use --per-device-bs"
        )
    print("\n".join(["", *lines, ""]), flush=True)


def progress_bar(
    accelerator: Accelerator, *, total: int, initial: int, desc: str, samples_per_step: int = 1
) -> tqdm:
    """One bar for the whole job (main process only); counts optimizer steps, shows samples/s."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="sample" if samples_per_step > 1 else "step",
        unit_scale=samples_per_step if samples_per_step > 1 else False,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=not accelerator.is_main_process,
        file=sys.stdout,
    )


def format_metrics(metrics: dict[str, float]) -> str:
    """`loss 0.1234  acc 0.98`: metrics on one line, floats to 4 significant digits."""
    return "  ".join(
        f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
        for key, value in metrics.items()
    )
