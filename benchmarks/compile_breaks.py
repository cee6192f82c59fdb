"""The graph breaks that remain under `--compile`, per recipe (the list in docs/compile.md).

Each recipe trains a few optimizer steps and evaluates once with --compile, at the tests' tiny
sizes (tests/processes.py *_TINY; a recipe not listed in SIZES, as a new one, at its own
CHECK_ARGS), on the CPU, in this process; dynamo's own counters then give
the graphs it compiled, its recompilations and every graph break with its reason. Breaks and
graphs are the same on a GPU for the same code path, but pointcloud's point ops take another
path there (POINTCLOUD_KERNELS), so its list is the CPU's.

Graph breaks are dynamo's, decided while it traces, before any backend sees a graph, so the
default backend here is `eager` (ACCELERATE_DYNAMO_BACKEND, as an accelerate config sets it): the
same breaks as inductor's, without minutes of C++ code generation per recipe; `--backend inductor`
also times that.

    OMP_NUM_THREADS=1 python benchmarks/compile_breaks.py [RECIPE ...] [--backend inductor]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch._dynamo
from torch._dynamo.utils import counters

from accel_common.recipe_cli.entry import train_in_python
from accel_common.tools.check.recipe import discovered, find_recipe
from recipes import load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: tests/
from tests.processes import CAPTIONING_TINY, CRICKET_TINY, CRYSTAL_TINY, POINTCLOUD_TINY, REPO

SIZES = {
    "template": ["--hidden", "16", "--depth", "1"],
    "pointcloud": POINTCLOUD_TINY,
    "quality": [],  # its default backbone is timm's tiny test network
    "captioning": CAPTIONING_TINY,
    "crystal": CRYSTAL_TINY,
    "cricket": [*CRICKET_TINY, "--sample-every", "8", "--val-ratio", "0.02"],
}
STEPS = ["--epochs", "1", "--max-steps", "3", "--compile"]


def breaks(recipe: str, out: Path) -> tuple[float, dict[str, int], dict[str, int]]:
    """(seconds, dynamo's stats, {break reason: count}) of a short compiled run of `recipe`."""
    torch._dynamo.reset()
    counters.clear()
    script = REPO / "recipes" / f"train_{recipe}.py"
    sizes = SIZES[recipe] if recipe in SIZES else find_recipe(recipe).args
    argv = [*sizes, *STEPS, "--output-dir", str(out / recipe)]
    start = time.perf_counter()
    train_in_python(load_recipe(recipe).train, argv, out / recipe, script=script)
    seconds = time.perf_counter() - start
    return seconds, dict(counters["stats"]), dict(counters["graph_break"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = discovered()
    parser.add_argument("recipes", nargs="*", default=every, choices=[[], *every])
    parser.add_argument("--backend", default="eager", help="torch.compile backend")
    options = parser.parse_args()
    chosen = options.recipes or every
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = options.backend.upper()
    report = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in chosen:
            seconds, stats, reasons = breaks(recipe, Path(tmp))
            lines = [
                f"{recipe}: {stats.get('unique_graphs', 0)} graphs compiled, "
                f"{sum(reasons.values())} graph breaks, {seconds:.0f} s"
            ]
            # a reason's first line names it; the rest is dynamo's generic hint
            lines += [
                f"  {n} x {why.strip().splitlines()[0]}" for why, n in sorted(reasons.items())
            ]
            report.append("\n".join(lines))
    print("\n\n".join(report))


if __name__ == "__main__":
    main()
