"""The scaling benchmark's report: the table with its targets, the docs/BENCHMARKS.md section
(`write_section`, which every benchmark uses for its own section) and the plot; `run_benchmark`
measures, then writes both.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from accel_common.errors import RecipeError
from accel_common.tools.bench.measuring import (
    CASES,
    MIN_RATIO,
    REFERENCE,
    Case,
    Result,
    measure,
    process_counts,
)

SECTION_START = "<!-- scaling benchmark: written by `accel-recipes bench` -->"


SECTION_END = "<!-- end of scaling benchmark -->"


def verdict(result: Result, reference: Result | None) -> str:
    """The targets at 2 processes: the reference DDP loop's ratio, and the recipe's own floor."""
    if result.case.name == REFERENCE or result.case.independent or 2 not in result.rates:
        return "-"
    ratio = statistics.median(result.ratios(2))
    misses = []
    if reference is not None:
        floor = statistics.median(reference.ratios(2))
        if ratio < floor:
            misses.append(f"below DDP's {floor:.2f}")
    if ratio < MIN_RATIO.get(result.case.name, 0.0):
        misses.append(f"below {MIN_RATIO[result.case.name]:.1f}")
    return "met" if not misses else "**missed**: " + ", ".join(misses)


def fixed(value: object, form: str) -> str:
    """A table cell: `value` formatted, or '-' where it was not measured."""
    return "-" if value is None else form.format(value)


def table(results: Sequence[Result], counts: Sequence[int]) -> list[str]:
    reference = next((r for r in results if r.case.name == REFERENCE), None)
    many = [n for n in counts if n > 1]
    header = ["run", "model", "per-device batch"]
    header += [f"samples/s at {n}" for n in counts]
    header += [f"ratio {n}/1 [min, max]" for n in many] + [f"efficiency {n}" for n in many]
    header += [f"imbalance {n}" for n in many]
    header += [f"step ms {n}" for n in many] + [f"wait ms {n} [least, most]" for n in many]
    header += ["target"]
    lines = ["| " + " | ".join(header) + " |", "| --- | --- | " + "---: | " * (len(header) - 3)]
    lines[-1] += "--- |"
    for result in results:
        ratios = {n: result.ratios(n) for n in many}
        cells = [result.case.name, result.case.model, str(result.case.per_device_bs)]
        cells += [f"{result.rate(n):.1f}" for n in counts]
        cells += [
            f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]" for r in ratios.values()
        ]
        cells += [f"{statistics.median(r) / n:.0%}" for n, r in ratios.items()]
        cells += [fixed(result.imbalance(n), "{:.3f}") for n in many]
        cells += [fixed(result.step_ms(n), "{:.1f}") for n in many]
        cells += [fixed(result.wait_ms(n), "{0[0]:.1f}, {0[1]:.1f}") for n in many]
        cells += [verdict(result, reference)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def section(results: Sequence[Result], counts: Sequence[int], gpus: bool, repeats: int) -> str:
    unit = "GPUs" if gpus else "CPU processes"
    device = f"{torch.cuda.get_device_name(0)}, nccl" if gpus else "gloo"
    lines = [
        SECTION_START,
        f"## Scaling: samples/s on {counts[0]} to {counts[-1]} {unit}",
        "",
        "Reproduce with `accel-recipes bench` (also run by `make bench`). Every run trains at",
        "the same per-device batch, so N processes do N times the work per step and perfect",
        "scaling is a ratio of N (efficiency = ratio / N). One thread per process",
        "(OMP_NUM_THREADS=1): 1 process uses one core, 2 use two. Runs at each process count",
        "alternate within every repeat; samples/s are medians over repeats, ratios are medians",
        "of per-repeat ratios of back-to-back runs [min, max]. Throughput is the recipes' own",
        "`train/samples_per_s` (`metrics.jsonl`), first logging window dropped, the rest pooled.",
        "",
        f"Measured on {platform.machine()}, {os.cpu_count()} cores, {device}, torch "
        f"{torch.__version__}, {repeats} repeats, {time.strftime('%Y-%m-%d')}.",
        "",
        *table(results, counts),
        "",
        f"`{REFERENCE}` is a hand-written loop (`python -m accel_common.tools.bench`,",
        "launched with `torchrun`): `DistributedDataParallel` (default buckets),",
        "`DistributedSampler`, AdamW, on the template's data and model (its CSV, and an MLP",
        "of its shape and initial weights written out). `template` is the template recipe on",
        "the same model, data, batch and optimiser (AdamW at a constant 1e-3; data large",
        "enough that no epoch ends inside the measured steps), so the gap between the two rows",
        "is what Accelerate and the recipe's loop cost. (With the template's own LR this model",
        "diverges, and the denormal floats that follow slow a CPU step by up to 40%.) Targets:",
        "every recipe at least the reference's ratio; the point-cloud recipe at its default size",
        "at least 1.8. `pointcloud, independent runs` is the ceiling the",
        "machine allows: N unconnected 1-process runs at once, rates summed; a DDP ratio near",
        "it is lost to the machine (shared cores, other load), not to communication. Recipe",
        "runs pass `--max-steps` and `--log-every` (and `--sample-steps 2` to the point-cloud",
        "recipe, `--val-ratio 0.02 --test-ratio 0.02` to cricket's: they only shorten the final",
        "evaluation, after the measured steps); the recipes run at their defaults otherwise.",
        "`crystal, per-process BatchNorm` is the crystal run with `--no-sync-batchnorm`: each",
        "process normalises with its own rows' statistics, as plain DDP does, so it does not",
        "take one process's steps; its gap to `crystal` is what the synchronised BatchNorms'",
        "small all-reduces (one per BatchNorm in forward, one in backward) cost on this machine.",
        "",
        "Where the time goes at N processes: `imbalance N` is the recipe's logged",
        "`train/rank_imbalance`, the busiest process's item cost (edges, graph nodes, tokens)",
        "over the mean, per optimizer step, averaged (`-`: items of one size, nothing balanced;",
        "crystal, cricket and captioning balance each step's items over the processes,",
        "`accel_common/batch_lr/balance.py`). `step ms N` is the time of one optimizer step",
        "(accumulation steps included) at the launch's rate. `wait ms N [least, most]` is the",
        "time from a process's last gradient being ready (its last bucket's all-reduce starts)",
        "to the end of `backward()` (`accel_common/monitoring/sync_wait.py`; gloo only),",
        "averaged per step, for the process that waited least (about the communication itself)",
        "and most (communication plus waiting for the slowest process: imbalance, or a core",
        "shared with other work). A recipe below the reference with a small spread between the",
        "two waits loses its time elsewhere (its own per-step work); a large spread with an",
        "imbalance near 1 points at the machine.",
        "",
        "![throughput against process count](scaling.png)",
        SECTION_END,
    ]
    return "\n".join(lines) + "\n"


def write_section(
    path: Path, text: str, start: str = SECTION_START, end: str = SECTION_END
) -> None:
    """Replace the section of `path` from `start` to `end` with `text` (which holds both
    markers), or append it, leaving the rest as it was: each benchmark owns one section of
    docs/BENCHMARKS.md, so one benchmark's rerun never touches another's table."""
    old = path.read_text() if path.exists() else ""
    text = text.rstrip("\n") + "\n"
    if start in old and end in old:
        before, rest = old.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        new = before + text + ("\n" + after if after else "")
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def plot(results: Sequence[Result], counts: Sequence[int], unit: str, path: Path) -> None:
    """Throughput against process count, each run next to its perfect-scaling line."""
    try:  # not a dependency of the recipes themselves
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RecipeError("the plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for result in results:
        rates = [result.rate(n) for n in counts]
        (line,) = ax.plot(counts, rates, marker="o", label=result.case.name)
        ax.plot(counts, [rates[0] * n for n in counts], ls="--", lw=0.8, color=line.get_color())
    ax.set(xlabel=f"{unit}", ylabel="samples/s (log scale)", yscale="log", xticks=list(counts))
    ax.set_title("Throughput at a fixed per-device batch (dashed: perfect scaling)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # the legend sits outside the axes
    plt.close(fig)


def run_benchmark(
    out: Path, plot_path: Path, repeats: int, cpu: bool, cases: Sequence[Case] = CASES
) -> str:
    """Measure, then write the section into `out` and the plot; returns the section."""
    gpus = not cpu and torch.cuda.device_count() >= 2  # one GPU cannot show scaling: use CPUs
    counts = process_counts(gpus)
    cases = [case for case in cases if not (gpus and case.independent)]
    with tempfile.TemporaryDirectory(prefix="accel-bench-") as tmp:
        results = measure(cases, counts, gpus, repeats, Path(tmp))
    text = section(results, counts, gpus, repeats)
    write_section(out, text)
    plot(results, counts, "GPUs" if gpus else "CPU processes", plot_path)
    return text
