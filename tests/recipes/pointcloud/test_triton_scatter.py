"""The Triton gather / scatter kernels of recipes/pointcloud/gpu_scatter.py, run on the CPU under
Triton's interpreter in one child process (tests/recipes/pointcloud/triton_scatter_checks.py says
why and what each check compares), and ops.py's choice of them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from recipes.pointcloud import ops
from tests.processes import recipe_env
from tests.recipes.pointcloud import triton_scatter_checks as checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (it ships with torch's CUDA wheels)",
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    env = recipe_env(tmp_path_factory.mktemp("triton"))
    env.update(TRITON_INTERPRET="1", POINTCLOUD_KERNELS="triton")
    done = subprocess.run(
        [sys.executable, "-m", "tests.recipes.pointcloud.triton_scatter_checks"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {line["check"]: line for line in lines}


@pytest.mark.parametrize("check", [c.__name__ for c in checks.CHECKS])
def test_kernels_under_the_interpreter(results: dict[str, dict], check: str) -> None:
    assert check in results, f"{check} did not run"
    assert results[check]["error"] is None, results[check]["error"]


def test_ops_choose_the_kernels_only_where_they_are_right(monkeypatch: pytest.MonkeyPatch):
    x = torch.zeros(1, 2, 3)
    monkeypatch.setenv("POINTCLOUD_KERNELS", "triton")
    assert ops._scatter_kernels(x, x)
    # coordinates or weights that want a gradient: the kernels give them none
    assert not ops._scatter_kernels(x, x.clone().requires_grad_())
    # --deterministic: the kernels' atomic adds sum in arrival order
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not ops._scatter_kernels(x)
    monkeypatch.undo()
    monkeypatch.setenv("POINTCLOUD_KERNELS", "torch")
    assert not ops._scatter_kernels(x)
