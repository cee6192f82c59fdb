"""How fast the crystal recipe builds its graphs cold, and how fast a cached start is.

The structures are the recipe's own example (EMT-labelled crystals of 1 to 64 atoms, written by
`recipes.crystal.example.write_dataset`): 10,000 of them, and their first 1,000 as a second
file. For each size and worker count, `load_graphs` runs as the recipe calls it at its default
settings: cold into a fresh cache folder (reading the extxyz file, looking up the targets,
building the graphs, writing the Arrow cache), then cached (reading the cache back, plus the first
graph as the training loader would ask for it). Medians over the repeats. Run with `make bench`
(one thread: OMP_NUM_THREADS=1); it rewrites only its own section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import ase.io
import datasets
import matscipy

from accel_common.tools.bench.report import write_section
from recipes import load_recipe
from recipes.crystal.example import write_dataset

REPO = Path(__file__).resolve().parent.parent
SECTION_START = "<!-- graph-building benchmark: written by benchmarks/bench_graphs.py -->"
SECTION_END = "<!-- end of graph-building benchmark -->"
SETTINGS = dict(index=":", target="energy_per_atom", per_atom=False, cutoff=5.0, max_neighbors=12)
COLD_TARGET_PER_CORE = 500  # structures/s, issue 12
CACHED_TARGET_S = 2.0  # at 10,000 structures

RECIPE = load_recipe("crystal")


def example_files(folder: Path, sizes: list[int]) -> dict[int, Path]:
    """One extxyz file per size: the first `size` structures of one generated set."""
    largest = write_dataset(folder / str(max(sizes)), structures=max(sizes), seed=0)
    files = {max(sizes): largest / "structures.extxyz"}
    for size in sorted(set(sizes) - {max(sizes)}):
        frames = ase.io.read(files[max(sizes)], index=f":{size}", format="extxyz")
        files[size] = folder / str(size) / "structures.extxyz"
        files[size].parent.mkdir(parents=True)
        ase.io.write(files[size], frames, format="extxyz")
    return files


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the `--workers` processes)."""
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(path: Path, workers: int, repeats: int, cache_root: Path) -> dict[str, float]:
    """Median seconds of a cold build into a fresh cache folder (wall and CPU: on a shared
    machine the CPU time is what the build costs, the wall time what it also waited) and of a
    cached start."""
    cold, cold_cpu, cached = [], [], []
    for repeat in range(repeats):
        cache_dir = cache_root / f"{path.parent.name}-{workers}-{repeat}"
        options = dict(SETTINGS, non_periodic=False, workers=workers, cache_dir=cache_dir)
        started, started_cpu = time.perf_counter(), cpu_seconds()
        graphs, _, was_cached = RECIPE.load_graphs(path, **options)
        cold.append(time.perf_counter() - started)
        cold_cpu.append(cpu_seconds() - started_cpu)
        assert not was_cached
        started = time.perf_counter()
        graphs, _, was_cached = RECIPE.load_graphs(path, **options)
        RECIPE.CrystalGraphs(graphs)[0]
        cached.append(time.perf_counter() - started)
        assert was_cached
    return {
        "cold_s": statistics.median(cold),
        "cold_cpu_s": statistics.median(cold_cpu),
        "cached_s": statistics.median(cached),
        "atoms": sum(len(numbers) for numbers in graphs["numbers"]) / len(graphs),
    }


def section(rows: list[dict], repeats: int, load: tuple[float, float]) -> str:
    lines = [
        SECTION_START,
        "## Crystal graphs: cold build and cached start",
        "",
        "Reproduce with `python benchmarks/bench_graphs.py` (also run by `make bench`). The",
        "crystal recipe's example structures (EMT-labelled, 1 to 64 atoms), graphs at the",
        "recipe's defaults (5 angstrom, 12 neighbours). Cold: `load_graphs` into a fresh cache",
        "folder (read the extxyz file, look up the targets, build the graphs, write the Arrow",
        "cache). Cached start: `load_graphs` again, read back from that cache, plus the first",
        f"graph. Medians of {repeats} runs; one thread per process (OMP_NUM_THREADS=1).",
        "",
        f"Measured on {platform.machine()}, {os.cpu_count()} cores, matscipy "
        f"{matscipy.__version__}, datasets {datasets.__version__}, "
        f"{datetime.date.today().isoformat()}; load average {load[0]:.1f} before, "
        f"{load[1]:.1f} after (other work on the machine slows every number).",
        "",
        "| structures | mean atoms | `--workers` | cold: structures/s | cold: seconds "
        "| cold: structures per CPU second | cached start | targets |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        rate = row["structures"] / row["cold_s"]
        met = [row["structures"] / row["cold_cpu_s"] >= COLD_TARGET_PER_CORE]
        if row["structures"] >= 10_000:
            met.append(row["cached_s"] < CACHED_TARGET_S)
        lines.append(
            f"| {row['structures']:,} | {row['atoms']:.1f} | {row['workers']} | {rate:.0f} "
            f"| {row['cold_s']:.2f} s | {row['structures'] / row['cold_cpu_s']:.0f} "
            f"| {row['cached_s']:.3f} s "
            f"| {'met' if all(met) else '**missed**'} |"
        )
    lines += [
        "",
        f"Targets: at least {COLD_TARGET_PER_CORE} structures/s per core cold (judged on "
        "structures per CPU second of the build, which other work on the machine does not "
        f"change), and a cached start under {CACHED_TARGET_S:g} s at 10,000 structures.",
        SECTION_END,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "BENCHMARKS.md")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=3)
    cli = parser.parse_args()
    datasets.disable_progress_bars()
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        files = example_files(Path(tmp) / "data", cli.sizes)
        for size in sorted(files):
            for workers in cli.workers:
                result = measure(files[size], workers, cli.repeats, Path(tmp) / "cache")
                rows.append({"structures": size, "workers": workers, **result})
                print(rows[-1], flush=True)
    text = section(rows, cli.repeats, (load_before, os.getloadavg()[0]))
    write_section(cli.out, text, SECTION_START, SECTION_END)
    print(text)


if __name__ == "__main__":
    main()
