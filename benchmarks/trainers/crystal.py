"""crystal: jwchen25/comformer @7241ae8's own trainer, its Python API `train_from_extxyz` at its
defaults (iComformer, batch 64), against the recipe's preset (recipes/crystal/configs/
original.yaml), on the CPU. Both read the same structures.extxyz (the recipe's example data, in
the layout train_from_extxyz reads) for its `energy_per_atom`, split 80/10/10 with seed 123.
Its Python dependencies beyond this project's live in .originals/deps/comformer (`make bench`
says how to install them there) or on the given PYTHONPATH."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks.trainers.side import (
    REPO,
    STEPPED,
    Side,
    missing_modules,
    preset_side,
    stepped_times,
)

BATCH = 64  # train_from_extxyz's batch_size default, and the preset's bs
SMOKE_BATCH = 8
DEPS = REPO / ".originals" / "deps" / "comformer"
MODULES = ["jarvis", "pymatgen", "ignite", "sklearn", "joblib", "pydantic_settings"]


def batch(smoke: bool) -> int:
    return SMOKE_BATCH if smoke else BATCH


def write_data(folder: Path, steps: int, smoke: bool) -> Path:
    """EMT-labelled crystals, enough that one epoch of its 80% (drop_last) holds `steps`."""
    from recipes.crystal.example import write_dataset

    return write_dataset(folder, structures=-(-(steps * batch(smoke) + 1) * 5 // 4) + 1)


def recipe(data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """The preset (the recipe's CPU defaults at batch 8 under --smoke)."""
    return preset_side("crystal", data, work, steps, batch(smoke), smoke)


def original(src: Path, data: Path, work: Path, steps: int, smoke: bool) -> Side:
    """comformer.custom_train.train_from_extxyz, unchanged, at its defaults (its graphs built
    with joblib, 4 data workers) on the CPU."""
    side = Side([sys.executable, str(STEPPED)], work, step_times=stepped_times)
    side.stop_when_logged = True
    if not (src / "comformer" / "custom_train.py").is_file():
        side.missing = [f"{src}/comformer/custom_train.py (COMFORMER_SRC: jwchen25/comformer "
                        "@7241ae8)"]  # fmt: skip
        return side
    kwargs = {"extxyz_file": str(data / "structures.extxyz"),
              "target_property": "energy_per_atom", "output_dir": str(work / "out")}  # fmt: skip
    if smoke:
        kwargs |= {"batch_size": SMOKE_BATCH, "num_workers": 0}
    side.command += ["--call", "comformer.custom_train:train_from_extxyz", json.dumps(kwargs)]
    path = [str(src), *([str(DEPS)] if DEPS.is_dir() else [])]
    side.env["PYTHONPATH"] = os.pathsep.join(path)
    side.notes.append("train_from_extxyz at its defaults; stopped once its steps are logged "
                      "(benchmarks/trainers/stepped.py)")  # fmt: skip
    side.missing = missing_modules(MODULES, path)
    return side
