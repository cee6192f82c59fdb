"""End to end against the originals' own trainers (`make bench-gpu`): for each original whose
source is given (PCDIFF_SRC, COMFORMER_SRC, CROWDBT_SRC, CRICKET_SRC), the example data in the
original's own layout, its trainer run as a subprocess at its defaults and the recipe's preset
run as a subprocess, each for the same WARMUP + STEPS optimizer steps, and per side:

- the whole process: wall time, steps/s and samples/s (start-up, data loading, compilation,
  checkpointing and the end of the run included);
- after the warm-up: steps/s and samples/s from the trainer's own per-step log times (the
  recipe's metrics.jsonl at --log-every 1; pcdiff's log lines at --print_freq 1), data loading
  included;
- the step time without data loading, from benchmarks/gpu/steps.py's timed loop on synthetic
  inputs of the same sizes (pcdiff's network on its own CUDA kernels for the original's; neither
  trainer's logs time a step alone);

and the ratio recipe / original of each rate. A side that cannot run says why (source not given,
no adapter for its trainer yet, a module its trainer imports missing from this Python, its
timeout) and the others still run. `--smoke` runs the same path on any device in seconds: the
recipe at its CPU defaults, the original at the smallest sizes its flags allow under a short
timeout (pcdiff's CPU fallback ops are Python loops: it is expected to time out there, which the
record says).

    python benchmarks/bench_trainers.py --out runs/gpu [--docs docs/BENCHMARKS.md]
    python benchmarks/bench_trainers.py --smoke --out runs/trainers-smoke
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accel_common.errors import DataError
from accel_common.hardware.launch_guard import require_writable_folder
from accel_common.tools.bench.report import write_section

REPO = Path(__file__).resolve().parent.parent

SECTION_START = "<!-- trainers benchmark: written by benchmarks/bench_trainers.py -->"
SECTION_END = "<!-- end of trainers benchmark -->"
BATCH = 8  # pcdiff's --bs default, and its preset's (recipes/pointcloud/configs/original.yaml)
DEFECTS = 5  # SkullBreak: one sample per skull and defect type


@dataclass(frozen=True)
class Trainer:
    """One original's trainer and the recipe that ports it. `adapter` is None where this bench
    cannot yet drive the original's trainer."""

    name: str  # the recipe's workload (RECIPES)
    variable: str  # where its source is given
    adapter: Callable[..., Side] | None = None


@dataclass
class Side:
    """One process to run: its command, folder, environment, and what its logs give."""

    command: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    step_times: Callable[[Path], list[float]] = lambda cwd: []
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def skulls_for(steps: int) -> int:
    """Training skulls for exactly `steps` optimizer steps in one epoch of pcdiff's loader
    (batch 8, 5 samples per skull, drop_last)."""
    return -(-BATCH * steps // DEFECTS)


def write_skulls(folder: Path, steps: int, points: int) -> Path:
    from recipes.pointcloud.example import write_dataset

    return write_dataset(folder, train_skulls=skulls_for(steps), test_skulls=1,
                         points_per_skull=points)  # fmt: skip


def missing_modules(names: list[str]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


PCDIFF_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) : \[\s*\d+/\s*\d+\]\[\s*\d+/\s*\d+\]\s+loss:"
)


def pcdiff_step_times(cwd: Path) -> list[float]:
    """The times of pcdiff's per-step log lines (--print_freq 1) in its printed output."""
    log = cwd / f"{cwd.name}.out"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return [
        datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        for match in map(PCDIFF_LINE.match, lines)
        if match
    ]


OPEN3D_STUB = '''"""Stand-in for open3d (bench_trainers.py): pcdiff's data set imports it, and
uses it only for --augment True, off at its defaults; any use fails the run."""


def __getattr__(name):
    raise ImportError(f"open3d is not installed (open3d.{name} was used)")
'''


def pcdiff_original(src: Path, data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """pcdiff/train_completion.py at its defaults, one epoch of exactly `steps` steps, run from
    a copy in `work`: it writes its runs/ beside itself, and PCDIFF_SRC stays as it was."""
    side = Side([sys.executable], work, step_times=pcdiff_step_times)
    if not (src / "train_completion.py").is_file():
        side.missing = [f"{src}/train_completion.py (PCDIFF_SRC: pcdiff-implant's pcdiff/ folder)"]
        return side
    copy = work / "pcdiff"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("runs", "checkpoints", "__pycache__"))
    side.command.append(str(copy / "train_completion.py"))
    side.command += ["--path", str(data / "train.csv"), "--dataset", "SkullBreak", "--niter", "1"]
    side.command += ["--print_freq", "1", "--no-wandb", "--bs", str(BATCH)]
    side.notes.append("its defaults, with --niter 1 (one epoch of exactly the steps), "
                      "--print_freq 1 (a log line per step), --no-wandb")  # fmt: skip
    if smoke:  # the smallest sizes its flags allow, its CPU fallback ops
        side.command += ["--workers", "0", "--num_points", "256", "--num_nn", "64"]
        side.command += ["--width_mult", "0.25", "--vox_res_mult", "0.5", "--disable-compile"]
    side.missing = missing_modules(["matplotlib", "trimesh", "scipy", "tqdm"])
    if missing_modules(["open3d"]):
        stub = work / "stubs" / "open3d"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(OPEN3D_STUB)
        side.env["PYTHONPATH"] = str(work / "stubs")
        side.notes.append("open3d is absent here: a stand-in that fails on any use (only "
                          "--augment True, off at its defaults, uses it)")  # fmt: skip
    return side


def recipe_step_times(cwd: Path) -> list[float]:
    path = cwd / "recipe" / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["time"] for r in records if r.get("step") is not None and "train/loss" in r]


def pointcloud_recipe(data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """The recipe's preset of pcdiff's run (CPU defaults under --smoke) for `steps` steps."""
    command = [sys.executable, str(REPO / "recipes" / "train_pointcloud.py")]
    if not smoke:
        command += ["--config", str(REPO / "recipes/pointcloud/configs/original.yaml")]
    command += ["--data", str(data), "--output-dir", str(work / "recipe"), "--overwrite"]
    command += ["--epochs", "0", "--max-steps", str(steps), "--bs", str(BATCH)]
    command += ["--log-every", "1", "--sampler", "ddim", "--sample-steps", "1"]
    notes = ["--log-every 1 (a record per step); its end-of-run evaluation cut to one DDIM step "
             "on the one test skull (pcdiff samples only every 2000 epochs)"]  # fmt: skip
    env = {"PYTHONPATH": str(REPO)}
    return Side(command, work, env, recipe_step_times, notes)


TRAINERS = [
    Trainer("pointcloud", "PCDIFF_SRC", pcdiff_original),
    Trainer("crystal", "COMFORMER_SRC"),
    Trainer("quality", "CROWDBT_SRC"),
    Trainer("cricket", "CRICKET_SRC"),
]
RECIPES = {"pointcloud": pointcloud_recipe}


def process_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra`, whose PYTHONPATH goes ahead of the inherited
    one (on a GPU machine that one holds the unpacked wheels, `make gpu-pass WHEELS=`)."""
    env = {**os.environ, **extra}
    if "PYTHONPATH" in extra and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], os.environ["PYTHONPATH"]])
    return env


def run_side(side: Side, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """`side` run to its end (or `timeout`), with what its wall time and logs give."""
    if side.missing:
        return {"ran": False, "why": f"missing here: {', '.join(side.missing)}"}
    side.cwd.mkdir(parents=True, exist_ok=True)
    env = process_env(side.env)
    log = side.cwd / f"{side.cwd.name}.out"
    started = time.perf_counter()
    with log.open("w") as out:  # its own session: a timeout stops its data workers too
        process = subprocess.Popen(side.command, cwd=side.cwd, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    wall = time.perf_counter() - started
    times = side.step_times(side.cwd)
    row: dict[str, Any] = {"ran": True, "wall_s": wall, "logged_steps": len(times)}
    row |= {"command": " ".join(side.command), "notes": side.notes, "log": str(log)}
    if code is None or code != 0 or len(times) < steps:
        how = f"timed out after {timeout:.0f} s" if code is None else f"exit {code}"
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if code else []
        row["why"] = f"{how}, {len(times)} of {steps} steps logged" + "".join(
            f": {line[-200:]}" for line in tail
        )
        return row
    row |= {"steps_per_s": steps / wall, "samples_per_s": BATCH * steps / wall}
    timed = steps - warmup
    span = times[steps - 1] - times[warmup - 1] if warmup else None
    if span and span > 0:
        row |= {"steady_steps_per_s": timed / span, "steady_samples_per_s": BATCH * timed / span}
    return row


def step_time(original: bool, smoke: bool, steps: int, warmup: int) -> dict[str, Any]:
    """ms per step without data loading: benchmarks/gpu/steps.py's timed loop on synthetic
    inputs of the trainer's sizes (the original's network on pcdiff's CUDA kernels)."""
    from benchmarks.bench_gpu import pcdiff_kernels
    from benchmarks.gpu.steps import ORIGINAL, RECIPE, Skipped, Step, run
    from benchmarks.original_sizes import workloads

    (workload,) = workloads(smoke=smoke, only="pointcloud")
    reason = pcdiff_kernels()[1] if original else ""
    step = Step("pointcloud", "no", variant=ORIGINAL if original else RECIPE)
    try:
        result = run(step, workload, reason, smoke, steps, warmup)
    except Skipped as why:
        return {"step_ms_why": str(why)}
    except Exception as error:  # reported beside the trainers' numbers, which stand without it
        return {"step_ms_why": f"{type(error).__name__}: {error}"}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"step_ms": result["ms_per_step"], "step_ms_batch": workload.per_gpu_batch}


def compare(trainer: Trainer, args: argparse.Namespace) -> dict[str, Any]:
    """One workload: the recipe's side and the original's, and their ratios."""
    steps = args.warmup + args.steps
    entry: dict[str, Any] = {"workload": trainer.name, "source": trainer.variable}
    source = os.environ.get(trainer.variable, "")
    if trainer.name not in RECIPES or trainer.adapter is None:
        given = "given" if source else "not given"
        entry["why"] = (
            f"not run: {trainer.variable} {given}; this bench has no adapter for its trainer yet"
        )
        return entry
    work = (args.work or args.out / "trainers") / trainer.name
    # both loaders draw their points with replacement: the file's count changes no step
    data = write_skulls(work / "data", steps, 512 if args.smoke else 8192)
    recipe = RECIPES[trainer.name](data, work / "recipe-run", steps, args.smoke)
    entry["recipe"] = run_side(recipe, steps, args.warmup, args.timeout)
    if source:
        side = trainer.adapter(Path(source), data, work / "original-run", steps, args.smoke)
        timeout = args.original_timeout or args.timeout
        entry["original"] = run_side(side, steps, args.warmup, timeout)
    else:
        entry["original"] = {"ran": False, "why": f"not run: {trainer.variable} not given"}
    # after both processes, so that this process's GPU memory is not held while they run
    entry["recipe"] |= step_time(False, args.smoke, args.steps, args.warmup)
    if not source:
        return entry
    entry["original"] |= step_time(True, args.smoke, args.steps, args.warmup)
    for key in ("samples_per_s", "steady_samples_per_s"):
        ours, theirs = entry["recipe"].get(key), entry["original"].get(key)
        entry[f"ratio_{key}"] = ours / theirs if ours and theirs else None
    ours, theirs = entry["recipe"].get("step_ms"), entry["original"].get("step_ms")
    entry["ratio_step_ms"] = theirs / ours if ours and theirs else None
    return entry


def _num(value: float | None, form: str) -> str:
    return "" if value is None else form.format(value)


def section(record: dict[str, Any]) -> str:
    """The markdown section for docs/BENCHMARKS.md (under --smoke, a check's record only)."""
    when = f"{record['device']}, {record['versions']}, {record['date']}"
    steps, warmup = record["steps"], record["warmup"]
    title = "## The originals' trainers against the recipes, end to end"
    if record["smoke"]:
        title = "## Trainers end to end, smoke run: small sizes, a few steps, not a measurement"
    lines = [
        SECTION_START, title, "",
        f"Run on {when},",
        "with `benchmarks/bench_trainers.py` (`make bench-gpu`): each trainer as its own process",
        f"for {warmup} warm-up + {steps} optimizer steps at batch {BATCH}, on the example data",
        "in the original's layout. `process`: steps and samples over the whole",
        "process's wall time (start-up, data, compilation, checkpoints included); `after warm-up`:",
        "from each trainer's own per-step log times, data loading included; `step without data`:",
        "benchmarks/gpu/steps.py's timed loop on synthetic inputs of the same sizes. Ratios: the",
        "recipe's rate over the original's (above 1: the recipe is faster).", "",
        "| workload | side | process s | steps/s | samples/s | after warm-up samples/s "
        "| step without data ms | ran |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]  # fmt: skip
    notes = []
    for entry in record["workloads"]:
        if "why" in entry:
            lines.append(f"| {entry['workload']} | | | | | | | {entry['why']} |")
            continue
        for side in ("recipe", "original"):
            row = entry[side]
            ran = "yes" if "why" not in row else row["why"].replace("|", "/")
            step = _num(row.get("step_ms"), "{:.1f}") or row.get("step_ms_why", "")
            lines.append(
                f"| {entry['workload']} | {side} | {_num(row.get('wall_s'), '{:.1f}')} "
                f"| {_num(row.get('steps_per_s'), '{:.3f}')} "
                f"| {_num(row.get('samples_per_s'), '{:.2f}')} "
                f"| {_num(row.get('steady_samples_per_s'), '{:.2f}')} "
                f"| {step.replace('|', '/')} | {ran} |"
            )
            notes += [f"- {entry['workload']}, {side}: {note}" for note in row.get("notes", [])]
        ratios = [
            f"{label} {entry[key]:.2f}x"
            for key, label in (("ratio_samples_per_s", "process"),
                               ("ratio_steady_samples_per_s", "after warm-up"),
                               ("ratio_step_ms", "step without data"))
            if entry.get(key)
        ]  # fmt: skip
        if ratios:
            notes.append(f"- {entry['workload']}: recipe / original: {', '.join(ratios)}")
    lines += ["", *notes] if notes else []
    return "\n".join([*lines, "", SECTION_END])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for runs, table, JSON.")
    parser.add_argument("--docs", type=Path, help="Also rewrite this file's trainers section.")
    parser.add_argument(
        "--work", type=Path, help="Folder for the data and the runs (default: OUT/trainers)."
    )
    parser.add_argument("--steps", type=int, default=5, help="Optimizer steps after the warm-up.")
    parser.add_argument("--warmup", type=int, default=2, help="Optimizer steps before them.")
    parser.add_argument("--timeout", type=float, default=240, help="Seconds per process.")
    parser.add_argument(
        "--original-timeout", type=float, help="Seconds for an original's process (--timeout)."
    )
    parser.add_argument("--only", nargs="*", help="Workloads to run (default: all).")
    parser.add_argument("--smoke", action="store_true", help="Small sizes, any device (CI).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.steps < 1 or args.warmup < 1 or args.timeout <= 0:
        print("error: --steps, --warmup and --timeout must be at least 1", file=sys.stderr)
        return 2
    if args.smoke and args.docs:
        print("error: --smoke measures nothing worth a table: leave out --docs", file=sys.stderr)
        return 2
    names = [t.name for t in TRAINERS]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        print(f"error: --only {' '.join(unknown)}: choose from {', '.join(names)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        require_writable_folder(args.out, "--out")
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "versions": f"torch {torch.__version__}, CUDA {torch.version.cuda}",
        "date": datetime.date.today().isoformat(), "smoke": args.smoke,
        "steps": args.steps, "warmup": args.warmup, "workloads": [],
    }  # fmt: skip
    for trainer in TRAINERS:
        if args.only and trainer.name not in args.only:
            continue
        print(f"{trainer.name}: running", flush=True)
        record["workloads"].append(compare(trainer, args))
        (args.out / "trainers_bench.json").write_text(json.dumps(record, indent=1))
    text = section(record)
    (args.out / "trainers_bench.md").write_text(text + "\n")
    print(text)
    failed = [e["workload"] for e in record["workloads"] if "why" in e.get("recipe", {})]
    if args.docs and not failed:
        write_section(args.docs, text, SECTION_START, SECTION_END)
    if failed:  # the recipe's side is this project's: it must run; an original's may not
        print(f"error: the recipe's trainer failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
