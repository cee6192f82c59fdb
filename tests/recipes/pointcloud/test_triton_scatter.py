"""The Triton gather / scatter kernels of recipes/pointcloud/gpu_scatter.py, run on the CPU under
Triton's interpreter in one child process (tests/recipes/pointcloud/triton_scatter_checks.py says
why and what each check compares), each kernel compiled for an H100 (which the interpreter does not
do), and ops.py's choice of them."""

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


# each kernel's pointer arguments (in order; "{f}" is the features' dtype): the rest are ints
# and the BLOCK_ sizes
POINTERS = {
    "_grouping_fwd": ["{f}", "*i64", "{f}"],
    "_grouping_bwd": ["{f}", "*i64", "*fp32"],
    "_voxel_index": ["*fp32", "*i32", "*i32"],
    "_avg_voxelize_fwd": ["{f}", "*i32", "*i32", "*fp32"],
    "_avg_voxelize_bwd": ["{f}", "*i32", "*i32", "*fp32"],
    "_devoxelize_fwd": ["{f}", "*fp32", "*fp32"],
    "_devoxelize_bwd": ["*fp32", "*fp32", "*fp32"],
    "_interpolate_fwd": ["{f}", "*i64", "*fp32", "*fp32"],
    "_interpolate_bwd": ["*fp32", "*i64", "*fp32", "*fp32"],
}


@pytest.mark.parametrize("kernel", POINTERS)
def test_kernels_compile_for_an_h100(kernel: str, monkeypatch, tmp_path):
    """The interpreter runs Python, which accepts what Triton's compiler refuses (a constexpr
    assigned twice in an unrolled loop did): each kernel is compiled to a cubin for sm_90 with
    Triton's own ptxas, which needs no GPU, for float32 and bfloat16 features."""
    pytest.importorskip("triton.backends.nvidia", reason="triton has no CUDA backend here")
    import triton
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from recipes.pointcloud import gpu_scatter

    fn = getattr(gpu_scatter, kernel)
    if type(fn).__name__ != "JITFunction":
        pytest.skip("the kernels were imported under TRITON_INTERPRET=1")
    blocks = {"BLOCK_C": gpu_scatter.BLOCK_C, "BLOCK_P": gpu_scatter.BLOCK_P}
    blocks = {arg: size for arg, size in blocks.items() if arg in fn.arg_names}
    pointers = POINTERS[kernel]
    for dtype in ["*fp32", "*bf16"] if "{f}" in pointers else ["*fp32"]:
        signature = {arg: "constexpr" if arg in blocks else "i32" for arg in fn.arg_names}
        signature.update({fn.arg_names[i]: p.format(f=dtype) for i, p in enumerate(pointers)})
        source = triton.compiler.ASTSource(fn, signature, blocks)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], (kernel, dtype)
