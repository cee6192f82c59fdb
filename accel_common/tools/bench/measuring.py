"""Measuring the scaling benchmark: what to launch, launching it, and reading back what it did.

Each recipe trains at a fixed per-device batch, so N processes do N times the work per step and
perfect scaling is a ratio of N. Runs of different process counts alternate within every repeat
(1, 2, then 2, 1, ...) so that drift of the machine hits both; medians over repeats are
reported. Throughput comes from the recipe's own `train/samples_per_s` records in
`OUTPUT/logs/metrics.jsonl`: the first window (start-up, first allocations) is dropped, the rest
are pooled (samples / seconds). The data comes from each workload's example generator, found
by name (`accel_common.tools.example_data`): the library imports no recipe.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from accel_common.errors import RecipeError
from accel_common.monitoring.sync_wait import ENV as ACCEL_RECIPES_TIME_SYNC
from accel_common.monitoring.tracking import METRICS_FILE
from accel_common.tools.example_data import make_data
from accel_common.tools.ports import free_port

REPO = Path(__file__).resolve().parents[3]


CONFIGS = REPO / "accelerate_configs"


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
        options = {}
        if name == "template":  # one epoch covers the longest run: no epoch ends in the windows
            longest = max(c.max_steps * c.per_device_bs for c in cases if c.data == name)
            options["train_size"] = longest * max(counts)
        data[name] = make_data(name, target, **options)
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
