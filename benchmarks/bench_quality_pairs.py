"""Quality's pair forward: the original's two passes ('separate') against one ('joint').

One training step of the quality recipe's scorer (forward over a batch of pairs, Crowd-BT's
score difference, backward, Adam step) with `--pair-forward separate` (the i sides, then the j
sides, as the original: BatchNorm statistics per side) and `joint` (both sides in one pass).
Steps interleaved (joint, separate, joint, ...) so machine noise falls on both alike; medians.
The ratio is the claim. Run with `make bench` (it rewrites only its own section of
docs/BENCHMARKS.md); `--smoke` runs two steps of the recipe's CPU default, for CI.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch

from accel_common.tools.bench.report import write_section
from recipes.quality.model import QualityScorer

SECTION_START = (
    "<!-- quality pair-forward benchmark: written by benchmarks/bench_quality_pairs.py -->"
)
SECTION_END = "<!-- end of quality pair-forward benchmark -->"


def step_seconds(
    model: QualityScorer, optimizer: torch.optim.Optimizer, pairs: torch.Tensor, parts: int
) -> float:
    started = time.perf_counter()
    s_i, s_j = model(pairs, parts).chunk(2)
    torch.nn.functional.softplus(s_j - s_i).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started


def measure(backbone: str, size: int, batch: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = QualityScorer(backbone, num_annotators=2, dropout=0.2).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    pairs = torch.randn(2 * batch, 3, size, size)
    for parts in (1, 2):  # warm-up: allocations, kernel choice
        step_seconds(model, optimizer, pairs, parts)
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(steps):
        for parts in (1, 2):
            times[parts].append(step_seconds(model, optimizer, pairs, parts))
    return {"joint": statistics.median(times[1]), "separate": statistics.median(times[2])}


def report(numbers: dict[str, float], backbone: str, size: int, batch: int, steps: int) -> str:
    joint, separate = numbers["joint"], numbers["separate"]
    return f"""{SECTION_START}
## Quality: scoring a pair in one pass or two

Reproduce with `python benchmarks/bench_quality_pairs.py` (also run by `make bench`). One
training step of the quality scorer ({backbone}, {size} px, {batch} pairs: forward, Crowd-BT's
score difference, backward, Adam), medians of {steps} interleaved steps each; one thread,
{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end, {datetime.date.today()}.

| `--pair-forward` | seconds per step | vs joint |
| --- | ---: | ---: |
| `joint` (one pass over both sides) | {joint:.3f} | 1.00 |
| `separate` (the original's two passes; its preset) | {separate:.3f} | {separate / joint:.2f} |

`separate` is the original's step (BatchNorm statistics per side, running statistics updated
twice); `joint` normalises both sides with one set of statistics, in fewer, larger kernels.
On a loaded machine (the load average above) the two numbers are noisy: rerun on an idle one.
{SECTION_END}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the section into this Markdown file")
    parser.add_argument("--backbone", default="efficientnet_b0")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the CPU default, two steps")
    args = parser.parse_args()
    if args.smoke:
        args.backbone, args.size, args.batch, args.steps = "test_efficientnet_gn", 32, 2, 2
    numbers = measure(args.backbone, args.size, args.batch, args.steps)
    text = report(numbers, args.backbone, args.size, args.batch, args.steps)
    print(text)
    if args.out is not None:
        write_section(args.out, text, SECTION_START, SECTION_END)


if __name__ == "__main__":
    main()
