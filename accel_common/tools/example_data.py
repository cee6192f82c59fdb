"""`accel-recipes make-data`: which workload's generator writes its small synthetic data set.

The registry names each generator as "module:function" and imports it only when that workload is
asked for, so listing the names (the command's help, its error for an unknown name) imports no
workload module, and writing template data never loads PIL (the quality generator's).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from accel_common.errors import RecipeError

# workload name -> "module:function"; function(folder, *, seed=..., ...) writes the set and
# returns its folder
GENERATORS: dict[str, str] = {
    "template": "accel_common.data.template:write_dataset",
    "pointcloud": "accel_common.data.pointcloud:write_dataset",
    "quality": "accel_common.data.quality:write_dataset",
    "captioning": "accel_common.data.captioning:write_dataset",
    "crystal": "accel_common.data.crystal:write_dataset",
    "cricket": "accel_common.data.cricket:write_dataset",
}


def workloads() -> list[str]:
    """The names `make_data` accepts, without importing any generator."""
    return list(GENERATORS)


def generator(workload: str) -> Callable[..., Path]:
    """`workload`'s generator, imported on first use."""
    if workload not in GENERATORS:
        raise RecipeError(f"unknown workload '{workload}'; choose one of: {', '.join(workloads())}")
    module, function = GENERATORS[workload].split(":")
    return getattr(importlib.import_module(module), function)


def make_data(workload: str, out_dir: Path, *, force: bool = False, **options: object) -> Path:
    """Write `workload`'s synthetic set to `out_dir`, refusing to overwrite unless forced."""
    write_dataset = generator(workload)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise RecipeError(f"{out_dir} exists and is not empty; pass --force to write into it")
    return write_dataset(out_dir, **options)
