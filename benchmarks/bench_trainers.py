"""End to end against the originals' own trainers: for each original whose source is given
(PCDIFF_SRC, COMFORMER_SRC, CRICKET_SRC), the example data in the original's own layout, its
trainer run as a subprocess at its defaults and the recipe's preset run as a subprocess, each
for the same WARMUP + STEPS optimizer steps, interleaved over --repeats, and per side:

- time to first step: from the process's start to its first optimizer step (start-up and data
  processing included);
- the whole process: wall time, steps/s and samples/s;
- after the warm-up: samples/s from the trainer's per-step times (the recipe's metrics.jsonl at
  --log-every 1; pcdiff's log lines at --print_freq 1; cricketmodel's and ComFormer's trainers,
  which log no time per step, run unchanged under benchmarks/trainers/stepped.py, which logs
  one after each optimizer step), data loading included;
- on a GPU (pcdiff), the step time without data loading, from benchmarks/gpu/steps.py's timed
  loop on synthetic inputs of the same sizes;

and the ratio recipe / original of each, with its min and max over the repeats. The per-original
parts live in benchmarks/trainers/. A side that cannot run says why in one line (source not
given or not there, no adapter for its trainer, a module its trainer imports missing, its
timeout) and the others still run. `make bench-gpu` runs the GPU workload (pcdiff); `make bench`
runs the CPU ones (--cpu: cricketmodel, ComFormer), stopping each process once its steps are
logged. `--smoke` runs the same path in seconds: the recipes at their CPU defaults, the
originals at the smallest sizes their flags allow.

    python benchmarks/bench_trainers.py --out runs/gpu [--docs docs/BENCHMARKS.md]
    python benchmarks/bench_trainers.py --cpu --repeats 2 --out runs/cpu [--docs ...]
    python benchmarks/bench_trainers.py [--cpu] --smoke --out runs/trainers-smoke
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accel_common.errors import DataError
from accel_common.hardware.launch_guard import require_writable_folder
from accel_common.tools.bench.report import write_section
from benchmarks.trainers import cricket, crystal, pointcloud
from benchmarks.trainers.side import Side

REPO = Path(__file__).resolve().parent.parent

SECTION_START = "<!-- trainers benchmark: written by benchmarks/bench_trainers.py -->"
SECTION_END = "<!-- end of trainers benchmark -->"
# the CPU workloads' own section: `make bench` and `make bench-gpu` each rewrite only theirs
CPU_SECTION_START = "<!-- CPU trainers benchmark: written by benchmarks/bench_trainers.py --cpu -->"
CPU_SECTION_END = "<!-- end of CPU trainers benchmark -->"
QUALITY_WHY = (
    "not run: no adapter for Crowd-BT's trainer yet (its train.py could run offline at a small "
    "timm backbone: --backbone, and pretrained: false in its --config YAML; the bench does not "
    "yet write its image-pair layout)"
)


@dataclass(frozen=True)
class Trainer:
    """One original's trainer and the recipe that ports it: `workload` is its module in
    benchmarks/trainers/ (write_data, recipe, original, batch), None with `why` where this bench
    cannot drive the original's trainer; `gpu`: run by `make bench-gpu`, else by `make bench`."""

    name: str  # the recipe's workload
    variable: str  # where its source is given
    workload: ModuleType | None = None
    gpu: bool = False
    why: str = ""


TRAINERS = [
    Trainer("pointcloud", "PCDIFF_SRC", pointcloud, gpu=True),
    Trainer("crystal", "COMFORMER_SRC", crystal),
    Trainer("quality", "CROWDBT_SRC", why=QUALITY_WHY),
    Trainer("cricket", "CRICKET_SRC", cricket),
]


def process_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra`, whose PYTHONPATH goes ahead of the inherited
    one (on a GPU machine that one holds the unpacked wheels, `make gpu-pass WHEELS=`)."""
    env = {**os.environ, **extra}
    if "PYTHONPATH" in extra and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], os.environ["PYTHONPATH"]])
    return env


def stop(process: subprocess.Popen) -> None:
    """`process` and everything it started (its own session): its data workers too."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_side(side: Side, steps: int, warmup: int, timeout: float, batch: int = 8) -> dict[str, Any]:
    """`side` run to its end (or `timeout`, or its `steps` logged where it stops there), with
    what its wall time and logs give."""
    if side.missing:
        return {"ran": False, "why": f"missing here: {', '.join(side.missing)}"}
    side.cwd.mkdir(parents=True, exist_ok=True)
    env = process_env(side.env)
    log = side.cwd / f"{side.cwd.name}.out"
    started_at, started = time.time(), time.perf_counter()
    code: int | None = None
    with log.open("w") as out:
        process = subprocess.Popen(side.command, cwd=side.cwd, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        while time.perf_counter() - started < timeout:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = process.wait(timeout=0.5)
                break
            if side.stop_when_logged and len(side.step_times(side.cwd)) >= steps:
                code = 0  # what comes after its steps is no part of the comparison
                break
        stop(process)
    wall = time.perf_counter() - started
    times = side.step_times(side.cwd)[:steps]
    row: dict[str, Any] = {"ran": True, "wall_s": wall, "logged_steps": len(times)}
    row |= {"command": " ".join(side.command), "notes": side.notes, "log": str(log)}
    if times:
        row["first_step_s"] = times[0] - started_at
    if code != 0 or len(times) < steps:
        how = f"timed out after {timeout:.0f} s" if code is None else f"exit {code}"
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if code else []
        row["why"] = f"{how}, {len(times)} of {steps} steps logged" + "".join(
            f": {line[-200:]}" for line in tail
        )
        return row
    row |= {"steps_per_s": steps / wall, "samples_per_s": batch * steps / wall}
    timed = steps - warmup
    span = times[steps - 1] - times[warmup - 1] if warmup else None
    if span and span > 0:
        row |= {"steady_steps_per_s": timed / span, "steady_samples_per_s": batch * timed / span}
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


RATIOS = (  # key, label, whether the ratio is recipe / original (else original / recipe)
    ("samples_per_s", "process samples/s", True),
    ("steady_samples_per_s", "samples/s after warm-up", True),
    ("first_step_s", "time to first step", True),  # below 1: the recipe starts sooner
    ("step_ms", "step without data", False),  # a speed-up, as the rates
)


def ratios(entry: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per RATIOS key present on both sides of every repeat: the ratio of the repeats' means,
    and its min and max over the repeats' pairs."""
    found = {}
    for key, _, recipe_on_top in RATIOS:
        pairs = [
            (r.get(key), o.get(key))
            for r, o in zip(entry["recipe"], entry["original"], strict=True)
        ]
        if not pairs or not all(r and o for r, o in pairs):
            continue
        if not recipe_on_top:
            pairs = [(o, r) for r, o in pairs]
        each = [top / bottom for top, bottom in pairs]
        mean = sum(top for top, _ in pairs) / sum(bottom for _, bottom in pairs)
        found[key] = {"ratio": mean, "min": min(each), "max": max(each)}
    return found


def compare(trainer: Trainer, args: argparse.Namespace) -> dict[str, Any]:
    """One workload: the recipe's side and the original's, --repeats times, interleaved (the
    order swapped each repeat), and their ratios."""
    steps = args.warmup + args.steps
    entry: dict[str, Any] = {"workload": trainer.name, "source": trainer.variable}
    source = os.environ.get(trainer.variable, "")
    if trainer.workload is None:
        entry["why"] = trainer.why
        return entry
    module = trainer.workload
    entry |= {"batch": module.batch(args.smoke), "recipe": [], "original": []}
    work = ((args.work or args.out / "trainers") / trainer.name).resolve()
    data = module.write_data(work / "data", steps, args.smoke)
    timeout = args.original_timeout or args.timeout
    for repeat in range(args.repeats):
        order = ("recipe", "original") if repeat % 2 == 0 else ("original", "recipe")
        for side_name in order:
            folder = work / f"{side_name}-run-{repeat + 1}"
            shutil.rmtree(folder, ignore_errors=True)  # its processed data too: made afresh
            if side_name == "recipe":
                side = module.recipe(data, folder, steps, args.smoke)
                row = run_side(side, steps, args.warmup, args.timeout, entry["batch"])
            elif source:
                side = module.original(Path(source).resolve(), data, folder, steps, args.smoke)
                row = run_side(side, steps, args.warmup, timeout, entry["batch"])
            else:
                row = {"ran": False, "why": f"not run: {trainer.variable} not given"}
            entry[side_name].append(row)
            print(f"{trainer.name} {side_name} {repeat + 1}: {row.get('why', 'ran')}", flush=True)
    if trainer.gpu:  # after the processes, so that this one holds no GPU memory while they run
        entry["recipe"][-1] |= step_time(False, args.smoke, args.steps, args.warmup)
        if source:
            entry["original"][-1] |= step_time(True, args.smoke, args.steps, args.warmup)
    entry["ratios"] = ratios(entry)
    return entry


def _num(value: float | None, form: str) -> str:
    return "" if value is None else form.format(value)


def markers(cpu: bool) -> tuple[str, str]:
    return (CPU_SECTION_START, CPU_SECTION_END) if cpu else (SECTION_START, SECTION_END)


def section(record: dict[str, Any], command: str) -> str:
    """The markdown section for docs/BENCHMARKS.md (under --smoke, a check's record only)."""
    steps, warmup = record["steps"], record["warmup"]
    start, end = markers(record["cpu"])
    title = "## The originals' trainers against the recipes, end to end" + (
        " on the CPU" if record["cpu"] else ""
    )
    if record["smoke"]:
        title = "## Trainers end to end, smoke run: small sizes, a few steps, not a measurement"
    lines = [
        start, title, "",
        f"Run on {record['device']} ({record['machine']}), {record['versions']}, "
        f"{record['date']}, with", "", f"    {command}", "",
        f"each trainer as its own process for {warmup} warm-up + {steps} optimizer steps, on",
        "the example data in the original's layout (the same files on both sides),",
        f"{record['repeats']} repeat(s), recipe and original interleaved. `first step s`:",
        "from the process's start to its first optimizer step (start-up and data processing",
        "included); `process`: steps and samples over the process's wall time; `after warm-up`:",
        "from the per-step times, data loading included; `step without data` (GPU only):",
        "benchmarks/gpu/steps.py's timed loop on synthetic inputs of the same sizes.", "",
        "| workload | side | run | first step s | process s | samples/s | after warm-up "
        "samples/s | step without data ms | ran |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]  # fmt: skip
    notes = []
    for entry in record["workloads"]:
        if "why" in entry:
            lines.append(f"| {entry['workload']} | | | | | | | | {entry['why']} |")
            continue
        for side in ("recipe", "original"):
            for run, row in enumerate(entry[side], 1):
                ran = "yes" if "why" not in row else row["why"].replace("|", "/")
                step = _num(row.get("step_ms"), "{:.1f}") or row.get("step_ms_why", "")
                lines.append(
                    f"| {entry['workload']} | {side} | {run} "
                    f"| {_num(row.get('first_step_s'), '{:.1f}')} "
                    f"| {_num(row.get('wall_s'), '{:.1f}')} "
                    f"| {_num(row.get('samples_per_s'), '{:.2f}')} "
                    f"| {_num(row.get('steady_samples_per_s'), '{:.2f}')} "
                    f"| {step.replace('|', '/')} | {ran} |"
                )
            for note in dict.fromkeys(n for row in entry[side] for n in row.get("notes", [])):
                notes.append(f"- {entry['workload']}, {side}: {note}")
        found = [
            f"{label} {entry['ratios'][key]['ratio']:.2f}x ({entry['ratios'][key]['min']:.2f}"
            f"-{entry['ratios'][key]['max']:.2f})"
            for key, label, _ in RATIOS
            if key in entry.get("ratios", {})
        ]
        if found:
            notes.append(f"- {entry['workload']}: recipe / original (min-max over the repeats; "
                         f"time to first step below 1 = sooner): {', '.join(found)}")  # fmt: skip
    lines += ["", *notes] if notes else []
    return "\n".join([*lines, "", end])


def cpu_model() -> str:
    """The CPU's model name and its core count, as /proc/cpuinfo gives them."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    names = re.findall(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return f"{names[0] if names else platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for runs, table, JSON.")
    parser.add_argument("--docs", type=Path, help="Also rewrite this file's trainers section.")
    parser.add_argument(
        "--work", type=Path, help="Folder for the data and the runs (default: OUT/trainers)."
    )
    parser.add_argument("--cpu", action="store_true", help="The CPU workloads (`make bench`).")
    parser.add_argument("--steps", type=int, default=5, help="Optimizer steps after the warm-up.")
    parser.add_argument("--warmup", type=int, default=2, help="Optimizer steps before them.")
    parser.add_argument("--repeats", type=int, default=1, help="Runs of each side, interleaved.")
    parser.add_argument("--timeout", type=float, default=240, help="Seconds per process.")
    parser.add_argument(
        "--original-timeout", type=float, help="Seconds for an original's process (--timeout)."
    )
    parser.add_argument("--only", nargs="*", help="Workloads to run (default: all).")
    parser.add_argument("--smoke", action="store_true", help="Small sizes, any device (CI).")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if min(args.steps, args.warmup, args.repeats) < 1 or args.timeout <= 0:
        print("error: --steps, --warmup, --repeats and --timeout must be at least 1",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.smoke and args.docs:
        print("error: --smoke measures nothing worth a table: leave out --docs", file=sys.stderr)
        return 2
    trainers = [t for t in TRAINERS if t.workload is None or t.gpu != args.cpu]
    names = [t.name for t in trainers]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        print(f"error: --only {' '.join(unknown)}: choose from {', '.join(names)}"
              f"{' (the GPU workloads: without --cpu)' if args.cpu else ''}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        require_writable_folder(args.out, "--out")
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.cpu
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "CPU", "machine": cpu_model(),
        "versions": f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if cuda else ""),
        "date": datetime.date.today().isoformat(), "smoke": args.smoke, "cpu": args.cpu,
        "repeats": args.repeats,
        "steps": args.steps, "warmup": args.warmup, "workloads": [],
    }  # fmt: skip
    for trainer in trainers:
        if args.only and trainer.name not in args.only:
            continue
        print(f"{trainer.name}: running", flush=True)
        record["workloads"].append(compare(trainer, args))
        (args.out / "trainers_bench.json").write_text(json.dumps(record, indent=1))
    sources = [f"{t.variable}={os.environ[t.variable]}" for t in trainers
               if t.workload and os.environ.get(t.variable)]  # fmt: skip
    command = " ".join([*sources, "python benchmarks/bench_trainers.py", *(argv or sys.argv[1:])])
    text = section(record, command)
    (args.out / "trainers_bench.md").write_text(text + "\n")
    print(text)
    failed = [
        e["workload"] for e in record["workloads"] if any("why" in r for r in e.get("recipe", []))
    ]
    if args.docs and not failed:
        write_section(args.docs, text, *markers(args.cpu))
    if failed:  # the recipe's side is this project's: it must run; an original's may not
        print(f"error: the recipe's trainer failed for {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
