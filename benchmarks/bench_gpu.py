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

    python benchmarks/bench_gpu.py --out runs/gpu [--docs docs/BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accel_common.tools.bench import write_section
from benchmarks.memory_estimate import estimate
from benchmarks.original_sizes import Workload, workloads

GIB = 2**30
PRECISIONS = ("no", "bf16", "fp16")
SECTION_START = "<!-- gpu benchmark: written by benchmarks/bench_gpu.py -->"
SECTION_END = "<!-- end of gpu benchmark -->"


def matmul_peak(size: int = 8192, repeats: int = 20) -> float:
    """TFLOP/s of a size^3 bf16 matrix product: what this GPU's matrix units reach in practice."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def measure(workload: Workload, precision: str, steps: int, warmup: int) -> dict[str, float]:
    """One workload at one precision: samples/s, peak GiB, TFLOP/s, fp16's skipped steps."""
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.cuda.empty_cache()  # the previous measurement's tensors are gone; so is its cache
    accelerator = Accelerator(mixed_precision=precision)
    torch.manual_seed(0)
    with torch.device(accelerator.device):
        model = workload.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = workload.batch(workload.per_gpu_batch, accelerator.device)
    skipped = 0

    def step() -> None:
        nonlocal skipped
        accelerator.backward(workload.loss(model, batch))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        skipped += int(accelerator.optimizer_step_was_skipped)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    return {
        "samples_per_s": workload.per_gpu_batch * steps / seconds,
        "ms_per_step": 1e3 * seconds / steps,
        "peak_gib": peak / GIB,
        "tflops": flops * steps / seconds / 1e12,
        "gflop_per_sample": flops / workload.per_gpu_batch / 1e9,
        "skipped_steps": skipped,
    }


def table(results: dict, device: str, peak: float, date: str, versions: str) -> str:
    """The markdown section for docs/BENCHMARKS.md."""
    lines = [
        SECTION_START,
        "## GPU: throughput, memory and TFLOP/s at the originals' sizes",
        "",
        f"Measured on {device}, {versions}, {date}, with `make bench-gpu`",
        "(benchmarks/bench_gpu.py: one process, synthetic inputs of the original's shapes, the",
        "recipe's model and loss through Accelerate with AdamW; data loading left out). An",
        f"8192^3 bf16 matrix product ran at **{peak:.0f} TFLOP/s** on this GPU in the same run.",
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
            lines.append(
                f"| {name} ({entry['size']}) | {entry['batch']} | "
                f"{'fp32' if precision == 'no' else precision} | {r['samples_per_s']:.1f} "
                f"| {r['ms_per_step']:.1f} | {r['samples_per_s'] / base:.2f}x "
                f"| {r['peak_gib']:.1f} GiB | {estimate_cell} | {r['tflops']:.1f} "
                f"| {100 * r['tflops'] / peak:.0f}% |"
            )
    lines += ["", SECTION_END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the table and JSON.")
    parser.add_argument("--docs", type=Path, help="Also rewrite this file's GPU section.")
    parser.add_argument("--steps", type=int, default=10, help="Timed steps per measurement.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed steps before them.")
    parser.add_argument("--only", nargs="*", help="Workloads to run (default: all).")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_gpu needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    peak = matmul_peak()
    print(f"{device}: 8192^3 bf16 matmul {peak:.0f} TFLOP/s", flush=True)
    results = {}
    for workload in workloads():
        if args.only and workload.name not in args.only:
            continue
        entry = {"size": workload.size, "batch": workload.per_gpu_batch}
        total = estimate(workload)["total_bytes"]
        entry["estimate_gib"] = None if total is None else total / GIB
        for precision in PRECISIONS:
            entry[precision] = measure(workload, precision, args.steps, args.warmup)
            print(f"{workload.name} {precision}: {json.dumps(entry[precision])}", flush=True)
        results[workload.name] = entry
    date = datetime.date.today().isoformat()
    section = table(results, device, peak, date, versions)
    summary = {"device": device, "versions": versions, "date": date, "matmul_tflops": peak}
    (args.out / "gpu_bench.json").write_text(json.dumps({**summary, "results": results}, indent=1))
    (args.out / "gpu_bench.md").write_text(section + "\n")
    if args.docs:
        write_section(args.docs, section, SECTION_START, SECTION_END)
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
