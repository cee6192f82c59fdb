"""GPU benchmark (`make bench-gpu`), in one run: training steps of every recipe at the
originals' sizes (fp32, bf16, fp16; pointcloud, captioning and crystal also compiled), the
recipe's PVCNN2 against pcdiff's own network on its CUDA kernels (PCDIFF_SRC), the point-cloud
ops one by one on the recipe's Triton kernels, its plain-PyTorch ops and pcdiff's kernels, and
the issue's speed targets checked against the same run's anchors.

The parts live in benchmarks/gpu/: steps.py (a training step: Accelerate, AdamW, WARMUP
untimed steps, STEPS timed between CUDA synchronisations, peak memory beside
benchmarks/memory_estimate.py's estimate, TFLOP/s from torch's FLOP counter against an 8192^3
bf16 matrix product measured in the same run), point_ops.py (each op at the sizes one PVCNN2
forward calls it with) and report.py (tables, ratios, targets). `fp32` is what a recipe gets
with `--mixed-precision no`: matrix products in full fp32, cuDNN convolutions in TF32.

The steps the targets read run first, then the point ops, then the rest; with `--budget S` a
measurement that would start too late to end within S seconds of the start is skipped and
listed as such, and the files in --out are rewritten after every measurement, so a run stopped
from outside still leaves what it measured.

`--smoke` runs every path at a small size for one step on whatever device there is, the CPU
included, and writes only into --out: every workload eager at every precision, pointcloud on
its plain-PyTorch ops, the point ops (PyTorch backend; Triton and pcdiff say why they are
skipped without CUDA or PCDIFF_SRC), and one workload compiled, captioning in fp32 and bf16,
with dynamo's `aot_eager` backend (Inductor's code generation takes 40 s to minutes per workload
on 2 CPU cores; `aot_eager` runs the same path through Accelerate and dynamo in seconds). CI
runs it (tests/tools/test_gpu_bench.py), so a path that no longer runs fails there, not on the next
GPU. A failure (an exception, or a loss or rate that is not finite) is reported and the rest
still runs; the command then exits 1, unless only the original's network failed (pcdiff's code
is not this project's: its failures are listed).

    python benchmarks/bench_gpu.py --out runs/gpu [--docs docs/BENCHMARKS.md] [--budget 195]
    python benchmarks/bench_gpu.py --smoke --out runs/gpu-smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accel_common.errors import DataError
from accel_common.hardware.launch_guard import require_writable_folder
from accel_common.monitoring.throughput import matmul_peak
from accel_common.tools.bench.report import write_section
from benchmarks.gpu import report
from benchmarks.gpu.point_ops import run_ops
from benchmarks.gpu.steps import (
    ORIGINAL,
    Skipped,
    Step,
    plan,
    run,
)
from benchmarks.memory_estimate import estimate
from benchmarks.original_sizes import Workload, workloads

GIB = 2**30
SMOKE_MATMUL = 256  # the matrix product's size under --smoke
# seconds a measurement must have left within --budget to start (estimates for one H100 at the
# originals' sizes: an eager step measurement 5-20 s, a compile 30-90 s, the point ops 20-40 s)
RESERVE = {"eager": 15, "compiled": 60, "ops": 30}


def pcdiff_kernels() -> tuple[Any, str]:
    """pcdiff's compiled backend (PCDIFF_SRC), or None and why not."""
    from tests.reference.pointcloud_kernels import load_pcdiff

    try:
        backend, reason = load_pcdiff(os.environ.get("PCDIFF_SRC"))
    except Exception as error:  # its own build: reported, the recipe's measurements still run
        traceback.print_exc()
        return None, f"pcdiff's kernels did not build: {type(error).__name__}: {error}"
    return (backend._real_backend if backend else None), reason


def triton_reason() -> str:
    from recipes.pointcloud.backend import TRITON_AVAILABLE

    if not torch.cuda.is_available():
        return "no CUDA GPU (the CPU suite tests the Triton kernels under TRITON_INTERPRET=1)"
    return "" if TRITON_AVAILABLE else "triton is not installed"


class Bench:
    """One run's record, rewritten into --out after every measurement."""

    def __init__(self, args: argparse.Namespace, peak: float, pcdiff: str) -> None:
        self.args, self.pcdiff, self.started = args, pcdiff, time.monotonic()
        cuda = torch.cuda.is_available()
        self.record: dict[str, Any] = {
            "device": torch.cuda.get_device_name() if cuda else "CPU",
            "versions": f"torch {torch.__version__}, CUDA {torch.version.cuda}",
            "date": datetime.date.today().isoformat(),
            "matmul_tflops": peak,
            "smoke": args.smoke,
            "pcdiff": pcdiff or "loaded",
            "steps": [],
            "skipped": {},
            "failed": {},
        }
        self.estimates: dict[str, float | None] = {}

    def out_of_time(self, kind: str) -> bool:
        left = self.args.budget - (time.monotonic() - self.started) if self.args.budget else 1e9
        return left < RESERVE[kind]

    def step(self, step: Step, workload: Workload, steps: int, warmup: int) -> None:
        label = step.label
        try:
            if self.out_of_time("compiled" if step.compiled else "eager"):
                raise Skipped(f"time budget ({self.args.budget} s)")
            result = run(step, workload, self.pcdiff, self.args.smoke, steps, warmup)
            row = asdict(step) | {"label": label, "size": workload.size}
            row |= {"batch": workload.per_gpu_batch, "estimate_gib": self.estimate(step, workload)}
        except Skipped as why:
            self.record["skipped"][label] = str(why)
            print(f"skipped: {label}: {why}", flush=True)
        except Exception as error:  # reported; the other measurements still run
            traceback.print_exc()
            self.record["failed"][label] = f"{type(error).__name__}: {error}"
            print(f"error: {label} failed: {self.record['failed'][label]}", flush=True)
        else:
            self.record["steps"].append(row | result)
            print(f"{label}: {json.dumps(result)}", flush=True)
        self.save()

    def estimate(self, step: Step, workload: Workload) -> float | None:
        """benchmarks/memory_estimate.py's fp32 estimate, for the recipe's network only."""
        if step.variant == ORIGINAL:
            return None
        if workload.name not in self.estimates:
            total = estimate(workload)["total_bytes"]
            self.estimates[workload.name] = None if total is None else total / GIB
        return self.estimates[workload.name]

    def ops(self, workload: Workload, kernels: Any, repeats: int) -> None:
        if self.out_of_time("ops"):
            self.record["skipped"]["point ops"] = f"time budget ({self.args.budget} s)"
            return
        reasons = {"torch": "", "triton": triton_reason(), "pcdiff": self.pcdiff}
        for backend, why in reasons.items():
            print(f"point ops on {backend}: {why or 'timed'}", flush=True)
        try:
            self.record["ops"] = run_ops(workload, kernels, reasons, repeats)
        except Exception as error:
            traceback.print_exc()
            self.record["failed"]["point ops"] = f"{type(error).__name__}: {error}"
        for call in self.record.get("ops", {}).get("calls", []):
            for backend in ("torch", "triton"):  # the recipe's; pcdiff's are listed only
                if "error" in call.get(backend, {}):
                    label = f"point op {call['op']} ({call['sizes']}) on {backend}"
                    self.record["failed"][label] = call[backend]["error"]
        self.save()

    def save(self) -> str:
        """The record, its ratios and targets so far into --out; returns the table."""
        report.add_ratios(self.record["steps"])
        self.record["targets"] = report.targets(self.record)
        (self.args.out / "gpu_bench.json").write_text(json.dumps(self.record, indent=1))
        section = report.section(self.record, SMOKE_MATMUL)
        (self.args.out / "gpu_bench.md").write_text(section + "\n")
        return section


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the table and JSON.")
    parser.add_argument("--docs", type=Path, help="Also rewrite this file's GPU section.")
    parser.add_argument("--steps", type=int, default=10, help="Timed steps per measurement.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed steps before them.")
    parser.add_argument("--only", nargs="*", help="Workloads to run (default: all).")
    parser.add_argument("--budget", type=float, help="Seconds: start nothing that would end later.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="Every path at a small size, one step, on any device (CI).",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.steps < 1 or args.warmup < 0 or (args.budget is not None and args.budget <= 0):
        print("error: --steps and --budget must be positive, --warmup at least 0", file=sys.stderr)
        return 2
    if args.smoke and args.docs:
        print("error: --smoke measures nothing worth a table: leave out --docs", file=sys.stderr)
        return 2
    try:  # a file or an unwritable folder would fail only at the first table, after a measurement
        require_writable_folder(args.out, "--out")
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print(
            "error: bench_gpu needs a CUDA GPU; this machine has none (--smoke runs anywhere)",
            file=sys.stderr,
        )
        return 2
    chosen = {w.name: w for w in workloads(smoke=args.smoke)}
    unknown = set(args.only or []) - set(chosen)
    if unknown:
        names = ", ".join(chosen)
        print(f"error: --only {' '.join(sorted(unknown))}: choose from {names}", file=sys.stderr)
        return 2
    names = [name for name in chosen if not args.only or name in args.only]
    steps, warmup = (1, 0) if args.smoke else (args.steps, args.warmup)
    args.out.mkdir(parents=True, exist_ok=True)
    peak = matmul_peak(SMOKE_MATMUL, 2) if args.smoke else matmul_peak()
    kernels, pcdiff = pcdiff_kernels() if "pointcloud" in names else (None, "not run (--only)")
    bench = Bench(args, peak, pcdiff)
    print(f"{bench.record['device']}: bf16 matmul {peak:.2f} TFLOP/s", flush=True)
    print(f"pcdiff's kernels: {pcdiff or 'loaded'}", flush=True)
    first, rest = plan(names, args.smoke)
    for step in first:
        bench.step(step, chosen[step.workload], steps, warmup)
    if "pointcloud" in names:
        bench.ops(chosen["pointcloud"], kernels, steps)
    for step in rest:
        bench.step(step, chosen[step.workload], steps, warmup)
    section = bench.save()
    print(section)
    for target in bench.record["targets"]:
        print(f"target {target['result']}: {target['target']} {target['measured']}")
    failed = bench.record["failed"]
    ours = [label for label in failed if f"({ORIGINAL})" not in label]
    if args.docs and not ours:
        write_section(args.docs, section, report.SECTION_START, report.SECTION_END)
    if len(ours) < len(failed):
        print("the original's network failed (listed above); the run does not fail for it")
    if ours:
        print(f"error: {len(ours)} measurement(s) failed: {', '.join(ours)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
