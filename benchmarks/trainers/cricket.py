"""cricket: lyndonkl/cricketmodel @a97d68e's own `python train.py` at its defaults against the
recipe's preset (recipes/cricket/configs/original.yaml), on the CPU. Both read the same
Cricsheet match files (the recipe's example data: the original's --data-dir layout, a folder of
match JSON) and split them the same way (80/10/10 by match, its seed 42)."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.trainers.side import (
    STEPPED,
    Side,
    missing_modules,
    preset_side,
    stepped_times,
)

BATCH = 64  # train.py's --batch-size default, and the preset's bs
SMOKE_BATCH = 8
SAMPLES_PER_MATCH = 180  # fewer than a simulated T20 match's deliveries: enough matches
MATCHES = 10  # the fewest whose 10% for validation holds one
MODULES = ["torch_geometric", "pandas", "tqdm", "yaml"]  # its pyproject's, that train.py imports


def batch(smoke: bool) -> int:
    return SMOKE_BATCH if smoke else BATCH


def write_data(folder: Path, steps: int, smoke: bool) -> Path:
    """Simulated matches, enough that its 80% for training holds `steps` batches."""
    from recipes.cricket.example import write_dataset

    matches = max(MATCHES, -(-steps * batch(smoke) // SAMPLES_PER_MATCH) * 5 // 4 + 2)
    return write_dataset(folder, matches=matches)


def recipe(data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """The preset (the recipe's CPU defaults at batch 8 under --smoke)."""
    return preset_side("cricket", data, work, steps, batch(smoke), smoke)


def original(src: Path, data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """Its train.py, unchanged, at its defaults (batch 64, 4 data workers, its data processing
    into one torch.save file per delivery, in a fresh --processed-dir each run) on the CPU."""
    side = Side([sys.executable, str(STEPPED)], work, step_times=stepped_times)
    side.stop_when_logged = True
    if not (src / "train.py").is_file():
        side.missing = [f"{src}/train.py (CRICKET_SRC: lyndonkl/cricketmodel @a97d68e)"]
        return side
    side.command += ["--script", str(src / "train.py"), "--data-dir", str(data)]
    side.command += ["--processed-dir", str(work / "processed"), "--force-cpu"]
    side.command += ["--checkpoint-dir", str(work / "checkpoints")]
    side.notes.append(
        "train.py at its defaults with --force-cpu, its data processed afresh; stopped once its "
        "steps are logged (benchmarks/trainers/stepped.py)"
    )
    if smoke:
        side.command += ["--batch-size", str(SMOKE_BATCH), "--num-workers", "0"]
    side.missing = missing_modules(MODULES)
    return side
