"""What a finished run left, read back and compared: its exported weights, its metrics log, and
the plan its `--dry-run` printed against what the run recorded in its export's `model.json`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from accel_common.batch_lr.batching import BatchPlan


def exported_params(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model" / "model.safetensors"))


def metrics_log(output_dir: Path) -> list[dict]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def per_step(output_dir: Path, key: str = "train/loss") -> dict[int, float]:
    """`key` at each logged step (the last record of a step logged twice)."""
    return {r["step"]: r[key] for r in metrics_log(output_dir) if key in r}


def relative_differences(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> dict[str, float]:
    """||a - b|| / ||a|| of each floating-point tensor (0 where both are equal, inf where `a` is
    zero and `b` is not). Integer and boolean tensors (BatchNorm's `num_batches_tracked`, index
    buffers) have no norm and no rounding: they must be equal, or the comparison fails
    (ValueError) naming the tensor; so must the keys."""
    if a.keys() != b.keys():
        raise ValueError(f"other tensors: {sorted(a.keys() ^ b.keys())[:3]}")
    differences = {}
    for name in a:
        if a[name].is_floating_point() or a[name].is_complex():
            size, distance = a[name].norm().item(), (a[name] - b[name]).norm().item()
            differences[name] = distance / size if size else (0.0 if not distance else math.inf)
        elif not torch.equal(a[name], b[name]):
            raise ValueError(f"{name}: {a[name]} != {b[name]}")
    return differences


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest of `relative_differences` (0 if none is floating-point)."""
    return max(relative_differences(a, b).values(), default=0.0)


def global_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all parameters at once."""
    if a.keys() != b.keys():
        raise ValueError(f"other tensors: {sorted(a.keys() ^ b.keys())[:3]}")
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
    return (diff / sum((a[k] ** 2).sum() for k in a) ** 0.5).item()


def max_relative_step_difference(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest |a - b| / |a| over the steps both logged (inf where one logged others)."""
    if a.keys() != b.keys() or not a:
        return math.inf
    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-30) for k in a)


def parse_plan(output: str) -> dict[str, str] | None:
    """The `name: value` lines of a `--dry-run`'s plan, or None if `output` holds none."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("dry run: ")), None)
    if start is None:
        return None
    rows = [line.strip().split(": ", 1) for line in lines[start + 1 :] if ": " in line]
    return {k: v for k, v in rows}


def plan_differences(plan: dict[str, str], export: dict, steps: int) -> list[str]:
    """Where the dry run's plan is not what its run (of at most `steps` optimizer steps) used,
    as the export's `model.json` records it: parameter counts, batch plan, LR line and steps."""
    counts = export["parameters"]
    printed = {k: v.removesuffix(" (not counted above)") for k, v in plan.items()}
    printed = {k: v for k, v in printed.items() if k in counts or k.startswith("parameters")}
    found = []
    if printed != {k: str(v) for k, v in counts.items()}:
        found.append(f"parameters: printed {printed}, trained {counts}")
    used = BatchPlan(**export["batch_plan"]).describe()
    if plan.get("batch") != used:
        found.append(f"batch: printed {plan.get('batch')!r}, used {used!r}")
    if plan.get("learning rate") != export["schedule"]["learning_rate"]:
        lr = export["schedule"]["learning_rate"]
        found.append(f"learning rate: printed {plan.get('learning rate')!r}, used {lr!r}")
    if not plan.get("epochs", "").endswith(f", at most {steps} steps"):
        found.append(f"epochs: printed {plan.get('epochs')!r}, for at most {steps} steps")
    if export["schedule"]["optimizer_steps"] != export["step"]:
        found.append(
            f"optimizer steps: scheduled {export['schedule']['optimizer_steps']}, "
            f"taken {export['step']}"
        )
    return found
