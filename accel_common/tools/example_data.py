"""`accel-recipes make-data`: which workload's generator writes its small synthetic data set.

Each recipe owns its generator, found by where it lives, so adding a recipe edits no registry:
`recipes/X/example.py:write_dataset` for a workload with a folder of its own, else
`recipes/train_X.py:write_dataset` (the one-file template and recipes copied from it). Listing
the names reads the folder only, so the command's help and its error for an unknown name import
no workload module, and writing template data never loads PIL (the quality generator's).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from accel_common.errors import RecipeError
from accel_common.run_folder.outputs import WRITE_ERRNOS, new_folder, unwritten

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def workloads() -> list[str]:
    """The names `make_data` accepts, without importing any generator."""
    return sorted(p.stem.removeprefix("train_") for p in RECIPES.glob("train_*.py"))


def generator_module(workload: str) -> str:
    """The module holding `workload`'s `write_dataset`."""
    if workload not in workloads():
        raise RecipeError(f"unknown workload '{workload}'; choose one of: {', '.join(workloads())}")
    if (RECIPES / workload / "example.py").is_file():
        return f"recipes.{workload}.example"
    return f"recipes.train_{workload}"


def generator(workload: str) -> Callable[..., Path]:
    """`workload`'s generator, imported on first use."""
    return importlib.import_module(generator_module(workload)).write_dataset


def make_data(workload: str, out_dir: Path, *, force: bool = False, **options: object) -> Path:
    """Write `workload`'s synthetic set to `out_dir` (made, or an empty folder), refusing a
    non-empty one unless forced; two at once into one folder: one set wins whole, the other
    process is told."""
    write_dataset = generator(workload)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(
            f"{out_dir} is a file, not a folder: give a folder to write the data set into (it is "
            "created if missing)"
        )
    above = next((p for p in out_dir.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise RecipeError(f"{out_dir}: {above} is a file, not a folder; give a folder's path")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise RecipeError(f"{out_dir} exists and is not empty; pass --force to write into it")
    if force:  # asked to write into what is there
        try:
            return write_dataset(out_dir, **options)
        except OSError as err:
            if err.errno not in WRITE_ERRNOS:
                raise
            raise unwritten(out_dir, "DIR", err, "the files written so far are in it") from None
    # written whole beside it, then moved into place: never mixed with another process's set
    with new_folder(out_dir, "DIR") as partial:
        write_dataset(partial, **options)
    return out_dir
