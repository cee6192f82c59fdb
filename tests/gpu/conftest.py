"""The GPU suite: every test here needs a CUDA GPU and is skipped cleanly without one (CI).

Run it with `make test-gpu` (or `pytest -m gpu tests/gpu`). With `GPU_OUT=DIR` in the
environment, each test appends what it measured (tolerances met, loss scales, skipped steps) to
DIR/gpu_suite.jsonl, so one remote command brings back the numbers with the pass/fail lines.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from accel_common.tools.check.recipe import discovered, find_recipe
from tests.processes import (
    CAPTIONING,
    CAPTIONING_TINY,
    CRICKET,
    CRICKET_TINY,
    CRYSTAL,
    CRYSTAL_TINY,
    POINTCLOUD,
    POINTCLOUD_TINY,
    QUALITY,
    TEMPLATE,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark everything under tests/gpu `gpu`, and skip it where no CUDA GPU is present."""
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine: make test-gpu)")
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


# recipe -> (script, data fixture, its flags besides the tests' step counts). Sizes are the CPU
# tests' small ones: the suite checks the GPU code paths; `make bench-gpu` measures the
# originals' sizes. Every other recipe there is (a new one) joins at the size it declares for
# `accel-recipes check` (CHECK_ARGS on CHECK_DATA's example: the data fixture None).
RECIPES: dict[str, tuple[Path, str | None, list[str]]] = {
    "template": (TEMPLATE, "template_data", ["--bs", "64", "--hidden", "256", "--depth", "3"]),
    "pointcloud": (POINTCLOUD, "pointcloud_data", [*POINTCLOUD_TINY, "--sample-steps", "4"]),
    "quality": (QUALITY, "quality_data", []),
    "captioning": (CAPTIONING, "captioning_data", CAPTIONING_TINY),
    # onecycle rises over --pct-start of the run: no --warmup-steps (the suite's 4 refused)
    "crystal": (CRYSTAL, "crystal_data", [*CRYSTAL_TINY, "--warmup-steps", "0"]),
    "cricket": (CRICKET, "cricket_data", [*CRICKET_TINY, "--sample-every", "8", "--bs", "16"]),
}
RECIPES |= {
    name: (recipe.script, None, recipe.args)
    for name in discovered()
    if name not in RECIPES and (recipe := find_recipe(name))
}


@pytest.fixture
def record(request: pytest.FixtureRequest):
    """`record(**numbers)`: keep what a test measured in $GPU_OUT/gpu_suite.jsonl (if set), with
    the seconds since the test started (the suite's time budget is checked from these)."""
    started = time.monotonic()

    def write(**numbers: object) -> None:
        out = os.environ.get("GPU_OUT")
        if not out:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        seconds = round(time.monotonic() - started, 1)
        entry = {"test": request.node.nodeid, "seconds": seconds, **numbers}
        with (Path(out) / "gpu_suite.jsonl").open("a") as handle:
            handle.write(json.dumps(entry, default=str) + "\n")

    return write
