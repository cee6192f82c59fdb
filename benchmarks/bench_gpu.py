"""GPU benchmark: step throughput, peak memory and achieved TFLOP/s per recipe at the originals'
sizes, in fp32, bf16 and fp16, on one GPU (`make bench-gpu`).

Each workload (benchmarks/original_sizes.py: the recipe's model and loss at the original's size,
synthetic inputs of the original's shapes) trains through Accelerate as the recipes do: autocast
and, for fp16, the dynamic loss scaler, AdamW. Per precision it runs WARMUP steps, then times
STEPS steps between CUDA synchronisations. Peak memory is the allocator's peak over the timed
steps (`torch.cuda.max_memory_allocated`, which leaves out the CUDA context), set against
benchmarks/memory_estimate.py's estimate. FLOPs per step come from torch's FLOP counter (matrix
products, convolutions, attention; forward and backward); TFLOP/s = FLOPs x steps / time, set
against an 8192^3 bf16 matrix product measured in the same run (the device's practical peak).

`fp32` is what a recipe gets with `--mixed-precision no`: PyTorch's defaults, so matrix products
in full fp32 and cuDNN convolutions in TF32.

`--smoke` runs every workload at a small size (original_sizes.py's smoke sizes) for one step per
precision on whatever device there is, the CPU included, and writes only into --out: CI runs it
(tests/test_gpu_bench.py), so a workload that no longer runs fails there, not on the next GPU.
A workload that fails (an exception, or a loss or rate that is not finite) is reported and the
others still run; the command then exits 1.

    python benchmarks/bench_gpu.py --out runs/gpu [--docs docs/BENCHMARKS.md]
    python benchmarks/bench_gpu.py --smoke --out runs/gpu-smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accel_common.tools.bench.report import write_section
from benchmarks.memory_estimate import estimate
from benchmarks.original_sizes import Workload, workloads

GIB = 2**30
PRECISIONS = ("no", "bf16", "fp16")
SECTION_START = "<!-- gpu benchmark: written by benchmarks/bench_gpu.py -->"
SECTION_END = "<!-- end of gpu benchmark -->"
SMOKE_MATMUL = 256  # the matrix product's size under --smoke


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts it (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_peak(size: int = 8192, repeats: int = 20) -> float:
    """TFLOP/s of a size^3 bf16 matrix product: what this device's matrix units reach in
    practice."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def measure(workload: Workload, precision: str, steps: int, warmup: int) -> dict[str, float]:
    """One workload at one precision: samples/s, peak GiB (CUDA only), TFLOP/s, the last
    loss, fp16's skipped steps. Raises if the loss or the rate is not finite."""
    AcceleratorState._reset_state(reset_partial_state=True)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()  # the previous measurement's tensors are gone; so is its cache
    accelerator = Accelerator(mixed_precision=precision)
    torch.manual_seed(0)
    with torch.device(accelerator.device):
        model = workload.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = workload.batch(workload.per_gpu_batch, accelerator.device)
    skipped = 0

    def step() -> torch.Tensor:
        nonlocal skipped
        loss = workload.loss(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        skipped += int(accelerator.optimizer_step_was_skipped)
        return loss.detach()

    for _ in range(warmup):
        step()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    result = {
        "samples_per_s": workload.per_gpu_batch * steps / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "peak_gib": peak,
        "tflops": flops * steps / seconds / 1e12,
        "gflop_per_sample": flops / workload.per_gpu_batch / 1e9,
        "loss": loss.float().item(),
        "skipped_steps": skipped,
    }
    if not all(math.isfinite(result[key]) for key in ("samples_per_s", "loss")):
        raise FloatingPointError(f"not finite: {result}")
    return result


def table(
    results: dict, device: str, peak: float, date: str, versions: str, smoke: bool = False
) -> str:
    """The markdown section for docs/BENCHMARKS.md (with `smoke`, a check's record only)."""
    if smoke:
        intro = [
            "## GPU benchmark smoke run: small sizes, one step, not a measurement",
            "",
            f"Run on {device}, {versions}, {date}, with `benchmarks/bench_gpu.py --smoke`; a",
            f"{SMOKE_MATMUL}^3 bf16 matrix product ran at {peak:.2f} TFLOP/s.",
        ]
    else:
        intro = [
            "## GPU: throughput, memory and TFLOP/s at the originals' sizes",
            "",
            f"Measured on {device}, {versions}, {date}, with `make bench-gpu`",
            "(benchmarks/bench_gpu.py: one process, synthetic inputs of the original's shapes, the",
            "recipe's model and loss through Accelerate with AdamW; data loading left out). An",
            f"8192^3 bf16 matrix product ran at **{peak:.0f} TFLOP/s** on this GPU in the same "
            "run.",
        ]
    lines = [
        SECTION_START,
        *intro,
        "",
        "| recipe (original size) | per-GPU batch | precision | samples/s | ms/step | vs fp32 "
        "| peak memory | estimate (fp32) | TFLOP/s | of the matmul peak |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, entry in results.items():
        base = entry["no"]["samples_per_s"]
        for precision in PRECISIONS:
            r = entry[precision]
            estimate = entry["estimate_gib"]
            estimate_cell = f"{estimate:.1f} GiB" if precision == "no" and estimate else ""
            peak_cell = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB"
            lines.append(
                f"| {name} ({entry['size']}) | {entry['batch']} | "
                f"{'fp32' if precision == 'no' else precision} | {r['samples_per_s']:.1f} "
                f"| {r['ms_per_step']:.1f} | {r['samples_per_s'] / base:.2f}x "
                f"| {peak_cell} | {estimate_cell} | {r['tflops']:.1f} "
                f"| {100 * r['tflops'] / peak:.0f}% |"
            )
    lines += ["", SECTION_END]
    return "\n".join(lines)


def run_workload(workload: Workload, steps: int, warmup: int) -> dict:
    """Every precision of one workload, printed as it goes, with its memory estimate."""
    entry = {"size": workload.size, "batch": workload.per_gpu_batch}
    total = estimate(workload)["total_bytes"]
    entry["estimate_gib"] = None if total is None else total / GIB
    for precision in PRECISIONS:
        entry[precision] = measure(workload, precision, steps, warmup)
        print(f"{workload.name} {precision}: {json.dumps(entry[precision])}", flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the table and JSON.")
    parser.add_argument("--docs", type=Path, help="Also rewrite this file's GPU section.")
    parser.add_argument("--steps", type=int, default=10, help="Timed steps per measurement.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed steps before them.")
    parser.add_argument("--only", nargs="*", help="Workloads to run (default: all).")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="Every workload at a small size, one step per precision, on any device (CI).",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        print("error: --steps must be at least 1 and --warmup at least 0", file=sys.stderr)
        return 2
    if args.smoke and args.docs:
        print("error: --smoke measures nothing worth a table: leave out --docs", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print(
            "error: bench_gpu needs a CUDA GPU; this machine has none (--smoke runs anywhere)",
            file=sys.stderr,
        )
        return 2
    chosen = workloads(smoke=args.smoke)
    unknown = set(args.only or []) - {w.name for w in chosen}
    if unknown:
        names = ", ".join(w.name for w in chosen)
        print(f"error: --only {' '.join(sorted(unknown))}: choose from {names}", file=sys.stderr)
        return 2
    steps, warmup = (1, 0) if args.smoke else (args.steps, args.warmup)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "CPU"
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    peak = matmul_peak(SMOKE_MATMUL, 2) if args.smoke else matmul_peak()
    print(f"{device}: bf16 matmul {peak:.2f} TFLOP/s", flush=True)
    results, failed = {}, {}
    for workload in chosen:
        if args.only and workload.name not in args.only:
            continue
        try:
            results[workload.name] = run_workload(workload, steps, warmup)
        except Exception as error:  # reported; the other workloads still run
            traceback.print_exc()
            failed[workload.name] = f"{type(error).__name__}: {error}"
            print(f"error: workload {workload.name} failed: {failed[workload.name]}", flush=True)
    date = datetime.date.today().isoformat()
    section = table(results, device, peak, date, versions, args.smoke)
    summary = {"device": device, "versions": versions, "date": date, "matmul_tflops": peak}
    summary |= {"smoke": args.smoke, "failed": failed}
    (args.out / "gpu_bench.json").write_text(json.dumps({**summary, "results": results}, indent=1))
    (args.out / "gpu_bench.md").write_text(section + "\n")
    if args.docs and not failed:
        write_section(args.docs, section, SECTION_START, SECTION_END)
    print(section)
    if failed:
        print(f"error: {len(failed)} workload(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
