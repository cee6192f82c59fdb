"""A recipe's memory per device, as `accel-recipes plan --measure` measured it: fixed + per sample.

The measurement (runs/memory/RECIPE.json, relative to the working directory, like the example
data) holds the peaks at a few per-device batches on one device and the straight line fitted
through them. `--max-per-device-bs auto` reads it here to cap the per-device batch for the device
a run is on; anything above the cap becomes gradient accumulation (accel_common.batch_lr.batching).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from accel_common.errors import ConfigError
from accel_common.run_folder.outputs import write_output
from accel_common.settings import describe_differences

MEMORY_DIR = Path("runs/memory")
# memory kept free: the CUDA context, the allocator's rounding and fragmentation, other processes
MARGIN = 0.10
# the fit is trusted up to this multiple of the largest measured batch, no further: memory that
# is not linear in the batch (sampled subgraphs: 94.5 nodes per seed at 64 seeds, 14.6 at 2048)
# made a straight line through small batches promise 100,000 seeds per device on 18,000 nodes
EXTRAPOLATION = 2
# per-sample memory between neighbouring measured batches that differs by more than this factor
# is not a line (fixed-size samples: equal to the byte, the template 76 B at 8-16 and 16-32)
NONLINEAR = 1.5


@dataclass
class MemoryFit:
    """peak(batch) = baseline + fixed + per_sample x batch (+ one set of gradients for DDP's
    buckets with more than one process), from peaks measured in fresh processes."""

    recipe: str
    device_kind: str  # "cuda" (the allocator's peak) or "cpu" (torch's CPU allocations' peak)
    device_name: str
    device_bytes: int
    baseline_bytes: int  # resident before the recipe ran (interpreter, libraries; 0 on a GPU)
    fixed_bytes: float  # weights, gradients, optimizer state, data
    per_sample_bytes: float  # activations and their gradients
    grad_bytes: int  # the parameters' size: DDP's gradient buckets with 2+ processes
    batches: list[int]
    peaks: list[int]
    flags: dict[str, Any]  # the recipe's own flags and precision when measured

    @property
    def ceiling(self) -> int:
        """The largest per-device batch the fit answers for (EXTRAPOLATION x the measured)."""
        return EXTRAPOLATION * max(self.batches)

    def predicted_batch(self, memory_bytes: float, processes: int = 1, sharing: int = 0) -> int:
        """The largest per-device batch whose predicted peak fits `memory_bytes` less MARGIN,
        by the line alone. `sharing`: that many processes share the memory (CPU RAM), each
        holding the baseline."""
        usable = memory_bytes * (1 - MARGIN)
        if sharing:
            usable = usable / sharing - self.baseline_bytes
        fixed = self.fixed_bytes + (self.grad_bytes if processes > 1 else 0)
        return max(0, math.floor((usable - fixed) / self.per_sample_bytes))

    def largest_batch(self, memory_bytes: float, processes: int = 1, sharing: int = 0) -> int:
        """`predicted_batch`, at most the `ceiling`: beyond it, measure larger batches."""
        return min(self.ceiling, self.predicted_batch(memory_bytes, processes, sharing))

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_output(path, json.dumps(asdict(self), indent=2))  # never through a link
        return path


def fit_line(batches: list[int], peaks: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of peaks over batches."""
    n = len(batches)
    mean_b, mean_p = sum(batches) / n, sum(peaks) / n
    spread = sum((b - mean_b) ** 2 for b in batches)
    slope = sum((b - mean_b) * (p - mean_p) for b, p in zip(batches, peaks, strict=True)) / spread
    return mean_p - slope * mean_b, slope


def nonlinearity(batches: list[int], peaks: list[int]) -> str | None:
    """Why a straight line does not describe the peaks (per-sample memory between neighbouring
    batches differing by more than NONLINEAR x, or not growing), or None; two batches cannot
    tell, and say so."""
    kib = [
        (peaks[i + 1] - peaks[i]) / (batches[i + 1] - batches[i]) / 1024
        for i in range(len(batches) - 1)
    ]
    if len(kib) < 2:
        return "two batches cannot show whether memory grows linearly; measure three (--measure-bs)"
    steps = ", ".join(
        f"{k:.1f} KiB at {a}-{b}" for k, a, b in zip(kib, batches, batches[1:], strict=False)
    )
    if min(kib) <= 0 or max(kib) > NONLINEAR * min(kib):
        return (
            f"memory is not linear in the batch (per sample: {steps}): samples whose size "
            "depends on the batch (sampled subgraphs, padding to the longest)? The table trusts "
            f"the line only up to {EXTRAPOLATION}x the largest measured batch"
        )
    return None


def present_device() -> tuple[str, str, int]:
    """(kind, name, total bytes) of the device this process trains on."""
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        props = torch.cuda.get_device_properties(index)
        return "cuda", props.name, props.total_memory
    return "cpu", "cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_flags(own: dict[str, Any], mixed_precision: Any) -> dict[str, Any]:
    """What a measurement must share with a run to apply to it, as it reads back from JSON."""
    return json.loads(json.dumps({**own, "mixed_precision": mixed_precision}, default=str))


def load_fit(recipe: str) -> MemoryFit:
    path = MEMORY_DIR / f"{recipe}.json"
    measure = f"accel-recipes plan --measure {recipe} [the same flags]"
    try:
        return MemoryFit(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(
            f"--max-per-device-bs auto: no memory measurement at {path}; run `{measure}` in this "
            "folder first"
        ) from None
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{path} is unreadable ({err}); measure again: {measure}") from None


def auto_max_per_device_bs(recipe: str, flags: dict[str, Any]) -> int:
    """The per-device batch cap for this device from the recipe's measurement, refusing one made
    on another kind of device or with other model flags."""
    fit = load_fit(recipe)
    kind, name, total = present_device()
    again = f"measure again here: accel-recipes plan --measure {recipe} [the same flags]"
    if (fit.device_kind, fit.device_name) != (kind, name):
        raise ConfigError(
            f"--max-per-device-bs auto: runs/memory/{recipe}.json was measured on "
            f"{fit.device_kind} {fit.device_name}, this process runs on {kind} {name}; {again}"
        )
    differences = describe_differences(fit.flags, flags)
    if differences:
        raise ConfigError(
            f"--max-per-device-bs auto: the measurement in runs/memory/{recipe}.json was made "
            f"with other flags ({differences.replace('checkpoint', 'measurement')}); {again}"
        )
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if kind == "cpu" else 0
    cap = fit.largest_batch(total, processes, sharing)
    if cap < 1:
        raise ConfigError(
            f"--max-per-device-bs auto: even one sample per device is predicted to need more "
            f"than the {total / 2**30:.1f} GiB of this {kind} less a {MARGIN:.0%} margin"
        )
    return cap


def parse_max_per_device_bs(value: str | None, recipe: str, flags: dict[str, Any]) -> int | None:
    """--max-per-device-bs: a positive integer, 'auto' (from the measurement), or None."""
    if value is None:
        return None
    if value == "auto":
        return auto_max_per_device_bs(recipe, flags)
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--max-per-device-bs {value}: give a positive integer or auto")
    return int(value)
