"""The batch plan: global batch = per-device batch x processes x accumulation steps, exactly.

Users arrive with one of two conventions. Some pass the GLOBAL batch (`--bs`, split across devices);
others pass the PER-DEVICE batch (`--per-device-bs`, multiplied by the device count). Mixing them up
is the classic scaling bug, and so is a silent `max(bs // world, 1)` that trains on a different
global batch than the one asked for. `plan_batch` accepts exactly one convention and refuses any
batch that cannot be split exactly, naming values that can.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

from accel_common.errors import ConfigError

SMALL_PER_DEVICE_BATCH = 4


class BatchPlanError(ConfigError):
    """A batch request that cannot be honoured exactly."""


class SmallBatchWarning(UserWarning):
    """A per-device batch small enough to hurt training."""


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's samples are spread over processes and micro-batches."""

    global_batch_size: int
    per_device_batch_size: int
    num_processes: int
    grad_accum_steps: int

    def __post_init__(self) -> None:
        product = self.per_device_batch_size * self.num_processes * self.grad_accum_steps
        if product != self.global_batch_size:
            raise BatchPlanError(
                f"inconsistent batch plan: {self.per_device_batch_size} per device x "
                f"{self.num_processes} processes x {self.grad_accum_steps} accumulation steps "
                f"= {product}, not {self.global_batch_size}"
            )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch_size} = {self.per_device_batch_size} per device"
            f" x {self.num_processes} processes x {self.grad_accum_steps} accumulation steps"
        )


def _nearby_multiples(value: int, step: int) -> list[int]:
    below = (value // step) * step
    candidates = [below, below + step] if below > 0 else [step, 2 * step]
    return [c for c in candidates if c > 0]


def _split_for_cap(samples: int, cap: int | None) -> int:
    """Fewest accumulation steps that cut `samples` into equal micro-batches of at most `cap`:
    `samples` over its largest divisor <= cap, found in min(cap, sqrt(samples)) trials (counting
    steps up from 2 ran for hours for a large prime --bs, even under --dry-run)."""
    if cap is None or samples <= cap:
        return 1
    small = [d for d in range(1, min(cap, math.isqrt(samples)) + 1) if samples % d == 0]
    sizes = small + [samples // d for d in small if samples // d <= cap]
    return samples // max(sizes)


def plan_batch(
    num_processes: int,
    *,
    global_batch_size: int | None = None,
    per_device_batch_size: int | None = None,
    grad_accum_steps: int = 1,
    max_per_device_batch_size: int | None = None,
    warn_small: bool = True,
) -> BatchPlan:
    """Build the plan from exactly one of `global_batch_size` or `per_device_batch_size`.

    With a global batch, the samples of one optimizer step are divided over processes and
    accumulation steps. With a per-device batch, the global batch grows with the process count.
    `max_per_device_batch_size` is a memory cap: a per-device batch above it is cut into equal
    micro-batches with more accumulation, keeping the global batch unchanged.
    """
    if (global_batch_size is None) == (per_device_batch_size is None):
        raise BatchPlanError(
            "give exactly one of --bs (global batch, split over all processes) or "
            "--per-device-bs (batch on each device); "
            + ("both were given" if global_batch_size is not None else "neither was given")
        )
    for name, value in (
        ("number of processes", num_processes),
        ("--grad-accum", grad_accum_steps),
        ("--bs", global_batch_size),
        ("--per-device-bs", per_device_batch_size),
        ("--max-per-device-bs", max_per_device_batch_size),
    ):
        if value is not None and value < 1:
            raise BatchPlanError(f"{name} must be a positive integer, got {value}")

    if global_batch_size is not None:
        divisor = num_processes * grad_accum_steps
        if grad_accum_steps > 1 and divisor > global_batch_size:  # a mistyped --grad-accum
            raise BatchPlanError(
                f"--grad-accum {grad_accum_steps}: more accumulation steps than --bs "
                f"{global_batch_size} has samples for on {num_processes} process(es) (each step "
                f"takes at least one); give at most {max(1, global_batch_size // num_processes)}"
            )
        if global_batch_size % divisor:
            valid = " or ".join(str(v) for v in _nearby_multiples(global_batch_size, divisor))
            raise BatchPlanError(
                f"--bs {global_batch_size} cannot be split evenly over {num_processes} processes"
                f" x {grad_accum_steps} accumulation steps; use a multiple of {divisor}, "
                f"e.g. --bs {valid}, or pass --per-device-bs instead"
            )
        samples_per_device = global_batch_size // num_processes
    else:
        assert per_device_batch_size is not None
        samples_per_device = per_device_batch_size * grad_accum_steps
        global_batch_size = samples_per_device * num_processes

    micro_steps = grad_accum_steps * _split_for_cap(
        samples_per_device // grad_accum_steps, max_per_device_batch_size
    )
    plan = BatchPlan(
        global_batch_size=global_batch_size,
        per_device_batch_size=samples_per_device // micro_steps,
        num_processes=num_processes,
        grad_accum_steps=micro_steps,
    )
    if warn_small and plan.per_device_batch_size < SMALL_PER_DEVICE_BATCH:
        warnings.warn(
            f"per-device batch is {plan.per_device_batch_size} ({plan.describe()}): such small "
            "batches give noisy gradients, leave the device mostly idle and break BatchNorm "
            "statistics; raise --bs or pass --per-device-bs to keep the per-device batch "
            "fixed as you add devices",
            SmallBatchWarning,
            stacklevel=2,
        )
    return plan


# The batch flags' meaning, declared once: a recipe's settings (accel_common.SharedSettings)
# and the `accel-recipes plan` and `doctor` commands all take their help from here.
BATCH_FLAG_HELP = {
    "bs": "GLOBAL batch per optimizer step, split over all processes (and accumulation steps). "
    "Give this or --per-device-bs, not both.",
    "per_device_bs": "Batch on EACH device per forward pass; the global batch grows with the "
    "number of processes. Give this or --bs, not both.",
    "grad_accum": "Micro-batches accumulated per optimizer step.",
    "max_per_device_bs": "Memory cap on the per-device batch: anything above it becomes gradient "
    "accumulation, keeping the global batch.",
}


@dataclass(frozen=True)
class BatchRequest:
    """The batch as asked for (--bs or --per-device-bs, --grad-accum, --max-per-device-bs): a
    plan once the process count is known. The run and its --dry-run plan through `plan`."""

    global_batch_size: int | None = None
    per_device_batch_size: int | None = None
    grad_accum_steps: int = 1
    max_per_device_batch_size: int | None = None

    def plan(self, num_processes: int, *, warn_small: bool = True) -> BatchPlan:
        return plan_batch(
            num_processes,
            global_batch_size=self.global_batch_size,
            per_device_batch_size=self.per_device_batch_size,
            grad_accum_steps=self.grad_accum_steps,
            max_per_device_batch_size=self.max_per_device_batch_size,
            warn_small=warn_small,
        )


def total_optimizer_steps(micro_batches_per_epoch: int, epochs: int, grad_accum_steps: int) -> int:
    """Optimizer steps in a run whose accumulation windows may straddle epoch boundaries."""
    return micro_batches_per_epoch * epochs // grad_accum_steps
