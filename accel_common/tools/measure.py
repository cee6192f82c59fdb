"""`accel-recipes plan --measure RECIPE [flags]`: what per-device batch fits, from measured memory.

Each measurement runs a few real training steps of the recipe at one per-device batch in a fresh
process (accel_common.tools.memory_probe), so nothing allocated by an earlier batch inflates a
later peak. A straight line through the peaks gives fixed + per-sample memory
(accel_common.batch_lr.memory.MemoryFit); from it the table gives, for 1..16 devices and common GPU
memory sizes, the largest per-device batch that fits with a margin, the accumulation that reaches
the global batch and the LR. Accelerate's find_executable_batch_size only halves a batch after an
out-of-memory error; this answers the question before a launch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand

from accel_common.batch_lr.batching import BatchPlanError, plan_batch
from accel_common.batch_lr.lr import LRScaling, scale_lr
from accel_common.batch_lr.memory import (
    EXTRAPOLATION,
    MARGIN,
    MEMORY_DIR,
    MemoryFit,
    fit_line,
    memory_flags,
    nonlinearity,
    present_device,
)
from accel_common.errors import RecipeError
from accel_common.recipe_cli.command_line import CLI_ONLY
from accel_common.recipe_cli.options import SharedSettings
from accel_common.tools.check.recipe import load_script

GPU_SIZES_GB = (24, 40, 80, 141)
# flags each measurement sets itself: the batch, a short run, a throw-away output folder
MEASUREMENT_FLAGS = {
    "bs", "per_device_bs", "max_per_device_bs", "grad_accum", "max_steps", "epochs",
    "output_dir", "save_every", "log_every", "resume", "overwrite", "report_to",
}  # fmt: skip


@dataclass
class PlanRow:
    """One line of the table: global = per_device x devices x accumulation, or does not fit."""

    memory: str
    devices: int
    fits: int  # the largest per-device batch that fits
    per_device: int | None
    accum: int | None
    global_batch: int | None
    lr: float | None
    basis: str  # measured (within the measured batches) or extrapolated


def recipe_command(recipe: str) -> tuple[Path, TyperCommand, tuple[int | None, int | None]]:
    """The recipe's script (a name like `template`, or a path), its click command and its
    default batch (global, per-device: one of them is set). A path that is not a recipe script
    (missing, a folder, not Python, not importable, no recipe `train`) is one line naming it."""
    what = f"--measure {recipe}"
    script, module = load_script(recipe, what)
    train = getattr(module, "train", None)
    if not hasattr(train, "default_batch"):
        raise RecipeError(
            f"{what} defines no recipe command `train` (a function decorated by "
            "accel_common.train_command, as in recipes/train_template.py)"
        )
    app = typer.Typer(add_completion=False)
    app.command()(train)
    return script, typer.main.get_command(app), train.default_batch


def parse_flags(
    command: TyperCommand, argv: list[str], default_batch: tuple[int | None, int | None]
) -> dict[str, Any]:
    """The recipe's parameters from `argv`, with its defaults (nothing runs)."""
    try:
        params = command.make_context(command.name or "recipe", list(argv)).params
    except typer.TyperException as err:  # typer's own click: a bad or unknown flag
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        raise RecipeError(f"recipe flags: {message}") from None
    if params["bs"] is None and params["per_device_bs"] is None:
        params["bs"], params["per_device_bs"] = default_batch
    return params


def strip_flags(command: TyperCommand, argv: list[str], names: set[str]) -> list[str]:
    """`argv` without the options whose parameter is in `names`, nor their values."""
    by_flag = {
        flag: param
        for param in command.params
        if param.param_type_name == "option"
        for flag in (*param.opts, *param.secondary_opts)
    }
    kept, i = [], 0
    while i < len(argv):
        flag, has_value, _ = argv[i].partition("=")
        param = by_flag.get(flag)
        if param is None or param.name not in names:
            kept.append(argv[i])
            i += 1
        else:
            i += 1 if has_value or param.is_flag else 2
    return kept


def probe(script: Path, args: list[str], workdir: Path) -> dict[str, Any]:
    """Run the recipe in a fresh process; its peak as JSON (accel_common.tools.memory_probe)."""
    out = workdir / f"probe-{len(list(workdir.glob('probe-*')))}.json"
    command = [sys.executable, "-m", "accel_common.tools.memory_probe", str(out), str(script)]
    result = subprocess.run([*command, *args], capture_output=True, text=True)
    if result.returncode != 0 or not out.is_file():
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        tail = errors[-1] if errors else "\n".join(result.stderr.splitlines()[-5:])
        raise RecipeError(f"the measurement run failed ({' '.join(args[-12:])}): {tail}")
    return json.loads(out.read_text())


def measure(recipe: str, argv: list[str], batches: list[int]) -> tuple[MemoryFit, dict]:
    """Peaks at `batches` (each in a fresh process), the line through them, and the recipe's
    parameters as `argv` sets them."""
    if len(set(batches)) < 2 or min(batches) < 1:
        raise RecipeError(f"--measure-bs {batches}: give two or more different positive batches")
    script, command, default_batch = recipe_command(recipe)
    params = parse_flags(command, argv, default_batch)
    base = strip_flags(command, argv, MEASUREMENT_FLAGS)
    with tempfile.TemporaryDirectory(prefix="accel-measure-") as tmp:
        workdir = Path(tmp)
        peaks, found = [], {}
        batches = sorted(set(batches))
        for batch in batches:
            found = probe(script, [*base, *short_run(batch, workdir)], workdir)
            peaks.append(found["peak"])
    fixed, per_sample = fit_line(batches, peaks)
    if per_sample <= 0:
        raise RecipeError(
            f"memory did not grow with the batch (peaks {peaks} at batches {batches}); measure "
            "at larger batches (--measure-bs)"
        )
    shared = {f.name for f in fields(SharedSettings)} | set(CLI_ONLY)
    own = {k: v for k, v in params.items() if k not in shared}
    total = present_device()[2]  # the probes ran on this process's device
    fit = MemoryFit(
        recipe=script.stem.removeprefix("train_"),
        device_kind=found["device_kind"],
        device_name=found["device_name"],
        device_bytes=total,
        baseline_bytes=found["baseline"],
        fixed_bytes=fixed,
        per_sample_bytes=per_sample,
        grad_bytes=found["grad_bytes"],
        batches=batches,
        peaks=peaks,
        flags=memory_flags(own, params.get("mixed_precision")),
    )
    return fit, params


def measure_peak(recipe: str, argv: list[str], batch: int) -> int:
    """One more peak, at `batch`, taken like the fit's."""
    script, command, _ = recipe_command(recipe)
    base = strip_flags(command, argv, MEASUREMENT_FLAGS)
    with tempfile.TemporaryDirectory(prefix="accel-measure-") as tmp:
        return probe(script, [*base, *short_run(batch, Path(tmp))], Path(tmp))["peak"]


def short_run(batch: int, workdir: Path) -> list[str]:
    """The flags of one measurement: `batch` per device, a few steps, nothing kept."""
    return [
        "--per-device-bs", str(batch), "--grad-accum", "1", "--epochs", "1",
        "--max-steps", "3", "--save-every", "0", "--log-every", "1000000",
        "--report-to", "none", "--output-dir", str(workdir / f"run-{batch}"),
    ]  # fmt: skip


def plan_rows(fit: MemoryFit, params: dict[str, Any], devices: list[int]) -> list[PlanRow]:
    """For each memory size and device count: what fits, the accumulation, the global batch and
    the scaled LR (from the recipe's --bs/--per-device-bs, --lr, --ref-bs, --lr-scaling)."""
    sizes = [(f"this {fit.device_kind} {fit.device_bytes / 2**30:.0f} GiB", fit.device_bytes)]
    sizes += [(f"{gb} GB", gb * 10**9) for gb in GPU_SIZES_GB]
    lr, ref_bs = params["lr"], params["ref_bs"]
    scaling = LRScaling(params["lr_scaling"])
    rows = []
    for index, (label, memory) in enumerate(sizes):
        for count in devices:
            sharing = count if index == 0 and fit.device_kind == "cpu" else 0
            fits = fit.largest_batch(memory, count, sharing)
            row = PlanRow(label, count, fits, None, None, None, None, "does not fit")
            if fits >= 1:
                try:
                    plan = plan_batch(
                        count,
                        global_batch_size=params["bs"],
                        per_device_batch_size=None if params["bs"] else params["per_device_bs"],
                        grad_accum_steps=params["grad_accum"],
                        max_per_device_batch_size=fits,
                        warn_small=False,
                    )
                except BatchPlanError:
                    row.basis = "batch not divisible"
                else:
                    row.per_device, row.accum = plan.per_device_batch_size, plan.grad_accum_steps
                    row.global_batch = plan.global_batch_size
                    row.lr = scale_lr(lr, ref_bs, plan.global_batch_size, scaling)
                    within = plan.per_device_batch_size <= max(fit.batches)
                    row.basis = "measured" if within and index == 0 else "extrapolated"
                    if fits < fit.predicted_batch(memory, count, sharing):
                        row.basis = "capped"
            rows.append(row)
    return rows


def describe(fit: MemoryFit) -> list[str]:
    """What was measured, and how the rest follows from it."""
    mib = 2**20
    peaks = ", ".join(
        f"{p / mib:.0f} MiB at {b}" for b, p in zip(fit.batches, fit.peaks, strict=True)
    )
    kind = "the CUDA allocator's peak" if fit.device_kind == "cuda" else "torch's CPU allocations"
    lines = [
        f"Measured on {fit.device_name}, each batch in a fresh process "
        f"({kind}): {peaks} per-device batch.",
        f"Fit: {fit.fixed_bytes / mib:.0f} MiB fixed + {fit.per_sample_bytes / 1024:.1f} KiB per "
        f"sample (+ {fit.grad_bytes / mib:.0f} MiB of gradient buckets with 2+ processes); "
        f"{MARGIN:.0%} of each memory is kept free.",
    ]
    if fit.device_kind == "cpu":
        lines.append(
            f"Each process also holds {fit.baseline_bytes / mib:.0f} MiB of interpreter and "
            "libraries (counted in this CPU's rows). GPU rows assume the same bytes per sample "
            "as this CPU run: a rough guide (CUDA workspaces and the allocator's rounding are not "
            "in it); measure on the GPU for real numbers."
        )
    warning = nonlinearity(fit.batches, fit.peaks)
    if warning:
        lines.append(f"warning: {warning}.")
    lines.append(
        "'measured': on this device within the measured batches; 'extrapolated': from the fit; "
        f"'capped': at {EXTRAPOLATION}x the largest measured batch, past which the fit is not "
        "trusted (measure larger batches for more). "
        f"Saved to {MEMORY_DIR / (fit.recipe + '.json')}: recipes take --max-per-device-bs auto."
    )
    return lines
