"""What every workload of benchmarks/bench_trainers.py builds: a `Side` (one process to run and
how its step times are read), and the readers of the step logs both kinds of side write."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEPPED = Path(__file__).resolve().parent / "stepped.py"


@dataclass
class Side:
    """One process to run: its command, folder, environment, and what its logs give.
    `stop_when_logged`: stopped once its log holds the steps asked for (the CPU workloads: what
    comes after, evaluation and export, is no part of the comparison and would double the run)."""

    command: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    step_times: Callable[[Path], list[float]] = lambda cwd: []
    notes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    stop_when_logged: bool = False


def missing_modules(names: list[str], path: list[str] | None = None) -> list[str]:
    """The modules of `names` that this Python (with `path` ahead of its own) cannot import."""
    saved = sys.path[:]
    sys.path[:0] = path or []
    try:
        return [name for name in names if importlib.util.find_spec(name) is None]
    finally:
        sys.path[:] = saved


def recipe_step_times(cwd: Path) -> list[float]:
    """The times of the recipe's per-step records (--log-every 1) in its metrics.jsonl."""
    path = cwd / "recipe" / "logs" / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["time"] for r in records if r.get("step") is not None and "train/loss" in r]


def stepped_times(cwd: Path) -> list[float]:
    """The times stepped.py logged after each of an original's optimizer steps."""
    path = cwd / "steps.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["time"] for line in lines if line.endswith("}")]


def recipe_side(script: str, flags: list[str], work: Path, steps: int, notes: list[str]) -> Side:
    """recipes/`script` with `flags` for exactly `steps` optimizer steps, a record per step. Its
    prepared-data cache in `work` (HF_DATASETS_CACHE): each run prepares its data afresh, as
    the originals' runs do, so that its time to first step includes that work."""
    command = [sys.executable, str(REPO / "recipes" / script), *flags]
    command += ["--output-dir", str(work / "recipe"), "--overwrite", "--epochs", "0"]
    command += ["--max-steps", str(steps), "--log-every", "1"]
    env = {"PYTHONPATH": str(REPO), "HF_DATASETS_CACHE": str(work / "datasets-cache")}
    return Side(command, work, env, recipe_step_times, notes, stop_when_logged=True)


def preset_side(workload: str, data: Path, work: Path, steps: int, batch: int, smoke: bool) -> Side:
    """A recipe's side: its preset configs/original.yaml at `batch`, or under --smoke its CPU
    defaults at the smoke batch."""
    flags = ["--data", str(data), "--bs", str(batch)]
    config = f"recipes/{workload}/configs/original.yaml"
    if not smoke:
        flags += ["--config", str(REPO / config)]
    notes = [f"{'its CPU defaults' if smoke else config}; stopped once its steps are logged"]
    return recipe_side(f"train_{workload}.py", flags, work, steps, notes)
