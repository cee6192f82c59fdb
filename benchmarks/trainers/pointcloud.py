"""pointcloud: pcdiff-implant's own train_completion.py against the recipe's preset
(recipes/pointcloud/configs/original.yaml), on a GPU (`make bench-gpu`): SkullBreak's layout
written from the recipe's example skulls."""

from __future__ import annotations

import datetime
import re
import shutil
import sys
from pathlib import Path

from benchmarks.trainers.side import REPO, Side, missing_modules, recipe_step_times

BATCH = 8  # pcdiff's --bs default, and its preset's (recipes/pointcloud/configs/original.yaml)
DEFECTS = 5  # SkullBreak: one sample per skull and defect type


def batch(smoke: bool) -> int:
    return BATCH


def skulls_for(steps: int) -> int:
    """Training skulls for exactly `steps` optimizer steps in one epoch of pcdiff's loader
    (batch 8, 5 samples per skull, drop_last)."""
    return -(-BATCH * steps // DEFECTS)


def write_data(folder: Path, steps: int, smoke: bool) -> Path:
    from recipes.pointcloud.example import write_dataset

    # both loaders draw their points with replacement: the file's count changes no step
    return write_dataset(folder, train_skulls=skulls_for(steps), test_skulls=1,
                         points_per_skull=512 if smoke else 8192)  # fmt: skip


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


def original(src: Path, data: Path, work: Path, steps: int, smoke: bool) -> Side:
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


def recipe(data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """The recipe's preset of pcdiff's run (CPU defaults under --smoke) for `steps` steps."""
    command = [sys.executable, str(REPO / "recipes" / "train_pointcloud.py")]
    if not smoke:
        command += ["--config", str(REPO / "recipes/pointcloud/configs/original.yaml")]
    command += ["--data", str(data), "--output-dir", str(work / "recipe"), "--overwrite"]
    command += ["--epochs", "0", "--max-steps", str(steps), "--bs", str(BATCH)]
    command += ["--log-every", "1", "--sampler", "ddim", "--sample-steps", "1"]
    notes = ["--log-every 1 (a record per step); its end-of-run evaluation cut to one DDIM step "
             "on the one test skull (pcdiff samples only every 2000 epochs)"]  # fmt: skip
    return Side(command, work, {"PYTHONPATH": str(REPO)}, recipe_step_times, notes)
