"""The GPU suite's commands, checked where CI runs: every recipe's flags in tests/gpu (the short
runs of test_recipes_on_gpu.py, per precision) are accepted by the recipe's `--dry-run` on the
CPU, so a renamed or retired flag fails here, not on the next GPU machine."""

from __future__ import annotations

import pytest

from recipes import load_recipe
from tests.gpu.conftest import RECIPES
from tests.gpu.test_recipes_on_gpu import COMMON
from tests.processes import dry_run_plan


@pytest.mark.parametrize("precision", ["no", "bf16", "fp16"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_gpu_suite_run_is_a_valid_command(recipe, precision, tmp_path):
    _script, _data, flags = RECIPES[recipe]
    args = ["--output-dir", str(tmp_path / "out"), "--mixed-precision", precision]
    plan = dry_run_plan(load_recipe(recipe).train, [*args, *COMMON, *flags])
    assert plan["mixed precision"] == precision, plan
