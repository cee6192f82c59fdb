"""Scaling benchmark: samples/s of every recipe on 1 and 2 CPU processes (1..N GPUs where there
are GPUs), next to a hand-written `torch.distributed` DDP loop, measured in one run.

Each recipe trains at a fixed per-device batch, so N processes do N times the work per step and
perfect scaling is a ratio of N. Runs of different process counts alternate within every repeat
(1, 2, then 2, 1, ...) so that drift of the machine hits both; medians over repeats are
reported. Throughput comes from the recipe's own `train/samples_per_s` records in
`OUTPUT/logs/metrics.jsonl`: the first window (start-up, first allocations) is dropped, the rest
are pooled (samples / seconds). `accel-recipes bench` runs it; `make bench` runs it after the
overhead benchmark. `python -m accel_common.tools.bench` is the reference DDP loop itself (one
process, or one worker of `torchrun`): the template's data reader and model, trained by plain
`torch.distributed` code that shares nothing with Accelerate or the recipes' loop.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from accel_common.errors import RecipeError
from accel_common.sync_wait import ENV as ACCEL_RECIPES_TIME_SYNC
from accel_common.sync_wait import SyncWaitTimer, timing_requested
from accel_common.tools.example_data import make_data
from accel_common.tools.ports import free_port
from accel_common.tracking import METRICS_FILE
from recipes.train_template import write_dataset as write_template_data

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "accelerate_configs"
SECTION_START = "<!-- scaling benchmark: written by `accel-recipes bench` -->"
SECTION_END = "<!-- end of scaling benchmark -->"
REFERENCE = "DDP reference"


@dataclass(frozen=True)
class Case:
    """One row of the table: what to launch, at which per-device batch, for how many steps."""

    name: str
    model: str  # shown in the table
    data: str  # workload whose example data it reads
    script: Path | None  # a recipe file; None: the reference DDP loop (this module)
    per_device_bs: int
    max_steps: int
    log_every: int
    args: tuple[str, ...] = ()
    # N processes = N separate 1-process runs at once, no communication: what the machine
    # itself allows (CPU only), to tell a recipe's shortfall from a busy or throttled machine
    independent: bool = False


# 4M parameters (8 -> 4 x 1152 -> 1): the calibration point for plain DDP on 2 cores
MLP_4M = ("--hidden", "1152", "--depth", "4")
# the reference's optimisation (AdamW at a constant 1e-3, whatever the batch): with the template's
# own defaults (3e-3 at batch 64, scaled linearly) this model diverges, and the denormal floats
# that follow slow a CPU step by up to 40%, which would be timed as if it were the recipe's cost
REFERENCE_OPTIM = ("--lr", "1e-3", "--lr-scaling", "none", "--schedule", "constant")

CASES = (
    Case(REFERENCE, "MLP 8-4x1152-1 (4.0M)", "template", None, 256, 40, 5, MLP_4M),
    Case(
        "template", "MLP 8-4x1152-1 (4.0M)", "template",
        REPO / "recipes" / "train_template.py", 256, 40, 5, MLP_4M + REFERENCE_OPTIM,
    ),
    Case(
        "pointcloud", "default (PVCNN2 x0.25, 16^3 / 8^3 / 4^3 voxels, 512 points)",
        "pointcloud",
        REPO / "recipes" / "train_pointcloud.py", 8, 45, 5, ("--sample-steps", "2"),
    ),
    Case(
        "pointcloud, independent runs", "as pointcloud, N separate 1-process runs at once",
        "pointcloud", REPO / "recipes" / "train_pointcloud.py", 8, 45, 5,
        ("--sample-steps", "2"), independent=True,
    ),
    Case(
        "quality", "default (test_efficientnet_gn, 32 px)", "quality",
        REPO / "recipes" / "train_quality.py", 32, 150, 15,
    ),
    Case(
        "captioning", "default (dim 64, 2 + 2 blocks, 32 px, 4 accumulation steps)", "captioning",
        REPO / "recipes" / "train_captioning.py", 16, 60, 6,
    ),
    Case(
        "crystal", "default (iComformer width 16, 4 convolutions, 8 neighbours)", "crystal",
        REPO / "recipes" / "train_crystal.py", 32, 40, 5,
    ),
    Case(
        # what its synchronised BatchNorms (about 20 small all-reduces a step) cost: the same
        # run with each process's own statistics, as plain DDP (not one process's steps)
        "crystal, per-process BatchNorm", "as crystal, --no-sync-batchnorm", "crystal",
        REPO / "recipes" / "train_crystal.py", 32, 40, 5, ("--no-sync-batchnorm",),
    ),
    Case(
        "cricket", "default (hidden 128, 3 HeteroConv layers, 4 heads)", "cricket",
        REPO / "recipes" / "train_cricket.py", 64, 40, 5,
        # its final evaluation of 10% + 10% of the matches took longer than the measured steps
        ("--val-ratio", "0.02", "--test-ratio", "0.02"),
    ),
)  # fmt: skip
# the point-cloud recipe's own target; every recipe must also reach the reference's ratio
MIN_RATIO = {"pointcloud": 1.8}


@dataclass(frozen=True)
class Launch:
    """What one launch measured: samples/s and, where logged, milliseconds per optimizer step
    (its global batch at that rate), the mean rank imbalance and the mean all-reduce wait per
    step of the process that waited least and most (milliseconds)."""

    rate: float
    step_ms: float | None = None
    imbalance: float | None = None
    wait_ms: tuple[float, float] | None = None


@dataclass
class Result:
    case: Case
    rates: dict[int, list[float]] = field(default_factory=dict)  # processes -> per repeat
    launches: dict[int, list[Launch]] = field(default_factory=dict)  # the same, in full

    def rate(self, n: int) -> float:
        return statistics.median(self.rates[n])

    def imbalance(self, n: int) -> float | None:
        """Median over repeats of the launches' mean imbalance (None: not logged)."""
        found = [r.imbalance for r in self.launches.get(n, []) if r.imbalance is not None]
        return statistics.median(found) if found else None

    def step_ms(self, n: int) -> float | None:
        """Median over repeats of the milliseconds per optimizer step (None: not known)."""
        found = [r.step_ms for r in self.launches.get(n, []) if r.step_ms is not None]
        return statistics.median(found) if found else None

    def wait_ms(self, n: int) -> tuple[float, float] | None:
        """Medians over repeats of the least and the most waiting process's ms per step."""
        found = [r.wait_ms for r in self.launches.get(n, []) if r.wait_ms is not None]
        if not found:
            return None
        return statistics.median(w[0] for w in found), statistics.median(w[1] for w in found)

    def ratios(self, n: int) -> list[float]:
        """Per-repeat N-process / 1-process ratios: runs made back to back, so drift cancels."""
        return [many / one for many, one in zip(self.rates[n], self.rates[1], strict=True)]


def environment(work: Path) -> dict[str, str]:
    """One thread per process (1 process = 1 core), nothing that waits on the network."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "HF_HOME": str(work / "hf"),
        "HF_HUB_OFFLINE": "1",
        "MASTER_ADDR": "127.0.0.1",
        ACCEL_RECIPES_TIME_SYNC: "1",  # the all-reduce wait (sync_wait.py), logged per window
    }


def launch_command(case: Case, nproc: int, gpus: bool, data: Path, out: Path) -> list[str]:
    """The command line a user would type: python / accelerate launch / torchrun."""
    args = ["--data", str(data), "--output-dir", str(out), "--per-device-bs"]
    args += [str(case.per_device_bs), "--max-steps", str(case.max_steps)]
    args += ["--log-every", str(case.log_every), *case.args, *([] if gpus else ["--cpu"])]
    if case.script is None:
        target = ["-m", "accel_common.tools.bench"]
        if nproc == 1:
            return [sys.executable, *target, *args]
        torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
        return [sys.executable, *torchrun, *target, *args]
    if nproc == 1 and not gpus:
        return [sys.executable, str(case.script), *args]
    config = CONFIGS / ("1gpu.yaml" if nproc == 1 else "2gpu.yaml" if gpus else "cpu_2proc.yaml")
    # `accelerate launch`, run as its module: the `accelerate` command also imports its memory
    # estimator's timm and torchvision, which would count ~4 CPU-s against every 2-process run
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--num_processes", str(nproc), "--main_process_port", str(free_port())]
    return [*launch, str(case.script), *args]


def steady_rate(metrics_jsonl: Path, skip: int = 1) -> float:
    """Samples/s after the first `skip` logging windows, pooled over the rest.

    Every window holds the same number of samples, so pooled samples / seconds is the harmonic
    mean of the windows' rates.
    """
    records = [json.loads(line) for line in metrics_jsonl.read_text().splitlines()]
    rates = [r["train/samples_per_s"] for r in records if "train/samples_per_s" in r]
    if len(rates) <= skip:
        raise RecipeError(f"{metrics_jsonl}: {len(rates)} throughput records, need > {skip}")
    return statistics.harmonic_mean(rates[skip:])


def steady_mean(metrics_jsonl: Path, key: str, skip: int = 1) -> float | None:
    """The mean of `key` over the logging windows after the first `skip` (every window has the
    same number of steps), or None where the run does not log it."""
    records = [json.loads(line) for line in metrics_jsonl.read_text().splitlines()]
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values[skip:]) if len(values) > skip else None


def read_launch(metrics_jsonl: Path) -> Launch:
    """Samples/s, step time, imbalance and all-reduce waits of one launch, first window
    dropped; the global batch comes from the run's logged config."""
    least = steady_mean(metrics_jsonl, "train/sync_wait_ms_min")
    most = steady_mean(metrics_jsonl, "train/sync_wait_ms_max")
    first = json.loads(metrics_jsonl.read_text().splitlines()[0])
    batch = first.get("config", {}).get("global_batch_size")
    rate = steady_rate(metrics_jsonl)
    return Launch(
        rate,
        1000 * batch / rate if batch else None,
        steady_mean(metrics_jsonl, "train/rank_imbalance"),
        None if least is None or most is None else (least, most),
    )


def run_case(case: Case, nproc: int, gpus: bool, data: Path, work: Path) -> Launch:
    """What one launch measured (for an `independent` case: nproc launches, rates summed)."""
    copies, per_copy = (nproc, 1) if case.independent else (1, nproc)
    outs = [Path(tempfile.mkdtemp(prefix=f"{case.data}-{nproc}-", dir=work)) for _ in range(copies)]
    commands = [launch_command(case, per_copy, gpus, data, out) for out in outs]
    logs = [out / "launch.log" for out in outs]  # files, not pipes: nothing can block on them
    running = []
    for command, log in zip(commands, logs, strict=True):
        with log.open("w") as sink:
            running.append(
                subprocess.Popen(
                    command, cwd=work, env=environment(work), stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
    for command, process, log in zip(commands, running, logs, strict=True):
        if process.wait(timeout=900) != 0:
            tail = log.read_text()[-3000:]
            raise RecipeError(f"{' '.join(command)} failed ({process.returncode}):\n{tail}")
    if case.independent:
        return Launch(sum(steady_rate(out / "logs" / METRICS_FILE) for out in outs))
    return read_launch(outs[0] / "logs" / METRICS_FILE)


def process_counts(gpus: bool) -> list[int]:
    """1 and 2 CPU processes, or 1, 2, 4, ... up to every GPU present."""
    if not gpus:
        return [1, 2]
    count = torch.cuda.device_count()
    return sorted({*(2**k for k in range(count.bit_length())), count})


def measure(
    cases: Sequence[Case],
    counts: Sequence[int],
    gpus: bool,
    repeats: int,
    work: Path,
) -> list[Result]:
    """Every case at every process count once per repeat; the order of counts alternates."""
    data = {}
    for name in sorted({case.data for case in cases}):
        target = work / "data" / name
        if name == "template":  # one epoch covers the longest run: no epoch ends in the windows
            longest = max(c.max_steps * c.per_device_bs for c in cases if c.data == name)
            data[name] = write_template_data(target, train_size=longest * max(counts))
        else:
            data[name] = make_data(name, target)
    results = [Result(case, {n: [] for n in counts}, {n: [] for n in counts}) for case in cases]
    for repeat in range(repeats):
        order = counts if repeat % 2 == 0 else counts[::-1]
        for result in results:
            for n in order:
                started = time.perf_counter()
                launch = run_case(result.case, n, gpus, data[result.case.data], work)
                result.rates[n].append(launch.rate)
                result.launches[n].append(launch)
                print(
                    f"repeat {repeat + 1}/{repeats} {result.case.name:>13} x{n}: "
                    f"{launch.rate:8.1f} samples/s ({time.perf_counter() - started:.0f} s)"
                )
    return results


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
        "`DistributedSampler`, AdamW, on the template's data and model (its reader and",
        "`MLPRegressor`, imported). `template` is the template recipe on the same",
        "model, data, batch and optimiser (AdamW at a constant 1e-3; data large enough that no",
        "epoch ends inside the measured steps), so the gap between the two rows is what",
        "Accelerate and the recipe's loop cost. (With the template's own LR this model diverges,",
        "and the denormal floats that follow slow a CPU step by up to 40%.) Targets: every",
        "recipe at least the reference's ratio; the point-cloud recipe at its default size at",
        "least 1.8. `pointcloud, independent runs` is the ceiling the",
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
        "`accel_common/balance.py`). `step ms N` is the time of one optimizer step",
        "(accumulation steps included) at the launch's rate. `wait ms N [least, most]` is the",
        "time from a process's last gradient being ready (its last bucket's all-reduce starts)",
        "to the end of `backward()` (`accel_common/sync_wait.py`; gloo only),",
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


# --------------------------------------------------------------------------- the reference loop


def load_recipe(name: str) -> ModuleType:
    """recipes/train_NAME.py as a module."""
    return importlib.import_module(f"recipes.train_{name}")


def reference_loop(argv: Sequence[str] | None = None) -> None:
    """Plain PyTorch DDP: what the recipes' scaling is held against. One process without
    torchrun, otherwise one worker of it; logs samples/s like the recipes do."""
    parser = argparse.ArgumentParser(description="Hand-written DDP loop (reference).")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--per-device-bs", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--log-every", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    template = load_recipe("template")  # the same data reader and model as the recipe
    dataset = template.load_split(args.data, "train")
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.per_device_bs, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    in_features = dataset.tensors[0].shape[1]
    model: nn.Module = template.MLPRegressor(in_features, args.hidden, args.depth).to(device)
    timer = None
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        if timing_requested():  # the recipes' timing of the all-reduce wait, for comparison
            timer = SyncWaitTimer()
            timer.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    log = None
    if rank == 0:
        (args.output_dir / "logs").mkdir(parents=True, exist_ok=True)
        log = (args.output_dir / "logs" / METRICS_FILE).open("w", buffering=1)
        # as the recipes' first record: the run's global batch (the benchmark's step time)
        log.write(json.dumps({"config": {"global_batch_size": args.per_device_bs * world}}) + "\n")
    samples = args.per_device_bs * world * args.log_every
    step, epoch, window_start = 0, 0, time.perf_counter()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = F.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            if timer is not None:
                timer.backward_done()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if timer is not None:
                timer.take_step()
            if step % args.log_every == 0:  # as the recipes log: the loss averaged over ranks
                loss = loss.detach()
                if distributed:
                    dist.all_reduce(loss)  # a sum: gloo has no average
                now = time.perf_counter()
                record = {"step": step, "train/loss": loss.item() / world}
                if timer is not None:
                    waits = [torch.zeros(1) for _ in range(world)]
                    dist.all_gather(waits, torch.tensor([timer.take_mean_ms()]))
                    record["train/sync_wait_ms_min"] = min(w.item() for w in waits)
                    record["train/sync_wait_ms_max"] = max(w.item() for w in waits)
                record["train/samples_per_s"] = samples / (now - window_start)
                window_start = now
                if log is not None:
                    log.write(json.dumps(record) + "\n")
            if step >= args.max_steps:
                break
        epoch += 1
    if log is not None:
        log.close()
    if distributed:
        dist.barrier()  # no rank tears gloo down while another still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    reference_loop()
    if "WORLD_SIZE" in os.environ:
        # A torchrun worker whose work is done and written ends here, without the interpreter's
        # teardown: on a loaded 2-core machine torch's gloo teardown at exit aborted about 1 run
        # in 4 ("terminate called without an active exception", torch 2.14.1; still 1 in 40
        # with the DDP model freed before the process group), after everything was written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
