"""The Triton gather / scatter kernels (recipes/pointcloud/gpu_scatter.py) on CPU tensors under
Triton's interpreter, reached through ops.py's dispatch: forward against the brute-force
references of pcdiff's kernels (tests/reference/pointcloud_reference.py), backward against
autograd of ops.py's plain-PyTorch path.

Run by tests/recipes/pointcloud/test_triton_scatter.py in a child process, because the
interpreter is chosen when `triton.jit` decorates the kernels (at the import of gpu_scatter), once
per process:
    TRITON_INTERPRET=1 POINTCLOUD_KERNELS=triton \
        python -m tests.recipes.pointcloud.triton_scatter_checks
prints one JSON line per check: its name, seconds, and the traceback where it failed.

Under the interpreter programs run one after another, so the kernels' atomic adds sum in a fixed
order: results here are exact where the arithmetic is the same as the plain path's (gathers,
forward sums in the same order), and float64 backward passes agree to 1e-12 relative (sum order
only). On a GPU the atomics sum in arrival order and nvcc-style FMA contraction may change last
bits: float32 there needs the ~1e-6 tolerances used below for backward passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np
import torch

from recipes.pointcloud import ops
from tests.reference import pointcloud_reference as ref

B, C, N = 2, 20, 150  # N over one block of 128 points and not a multiple of it; C over 16
R = 4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    os.environ["POINTCLOUD_KERNELS"] = "torch"
    try:
        yield
    finally:
        os.environ["POINTCLOUD_KERNELS"] = "triton"


def forward_backward(
    op: Callable, x: torch.Tensor, rest: tuple, grad: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """op(x, *rest) and the gradient of x for `grad` (or ones); raises unless the kernels ran
    where POINTCLOUD_KERNELS says triton (the custom op's backward node)."""
    x = x.detach().clone().requires_grad_()
    out = op(x, *rest)
    kernels = "pointcloud" in type(out.grad_fn).__name__
    assert kernels == (os.environ["POINTCLOUD_KERNELS"] == "triton"), type(out.grad_fn).__name__
    out.backward(torch.ones_like(out) if grad is None else grad)
    return out.detach(), x.grad


def compare(op: Callable, x: torch.Tensor, rest: tuple, rtol: float) -> torch.Tensor:
    """Kernels against the plain path: forward exactly, x's gradient within rtol of its
    largest magnitude. Returns the kernels' output."""
    grad = torch.randn(op(x, *rest).shape, generator=gen(99), dtype=torch.float64)
    out, dx = forward_backward(op, x, rest, grad.to(x.dtype))
    with torch_path():
        expected, dx_expected = forward_backward(op, x, rest, grad.to(x.dtype))
    assert out.dtype == expected.dtype and torch.equal(out, expected), op.__name__
    scale = dx_expected.abs().max().clamp_min(1e-30)
    error = ((dx - dx_expected).abs().max() / scale).item()
    assert dx.dtype == x.dtype and error <= rtol, f"{op.__name__} backward: {error} > {rtol}"
    return out


def grid_coords() -> torch.Tensor:
    """(B, 3, N) grid coordinates in [0, R - 1]: random, plus points on voxel boundaries (x.5,
    rounded half to even), on grid points (fraction 0) and at exactly R - 1 and 0."""
    coords = torch.rand(B, 3, N, generator=gen(1)) * (R - 1)
    x = [0.5, 1.5, 2.5, 3.0, 0.0, 1.0, 3.0, 2.5]
    y = [3.0, 2.5, 0.5, 3.0, 0.0, 2.0, 1.5, 3.0]
    z = [1.5, 0.5, 3.0, 3.0, 0.0, 3.0, 2.0, 0.5]
    coords[:, :, :8] = torch.tensor([x, y, z])
    return coords


def check_grouping() -> None:
    features = torch.randn(B, C + 4, N, generator=gen(2))[:, 2 : C + 2]  # a strided view
    index = torch.randint(0, N, (B, 30, 5), generator=gen(3))  # 150 slots, repeated points
    grouped = compare(ops.grouping, features.double(), (index,), rtol=1e-12)
    compare(ops.grouping, features, (index,), rtol=1e-6)
    expected = ref.grouping(features.double().numpy(), index.numpy())
    assert np.array_equal(grouped.numpy(), expected)
    empty, dx = forward_backward(ops.grouping, features[:, :0], (index,))  # temb of 0 channels
    assert empty.shape == (B, 0, 30, 5) and dx.shape == (B, 0, N)


def check_avg_voxelize() -> None:
    features = torch.randn(B, C, N, generator=gen(4))
    coords = grid_coords()
    voxels = compare(ops.avg_voxelize, features, (coords, R), rtol=0)  # backward: a gather
    compare(ops.avg_voxelize, features.double(), (coords.double(), R), rtol=0)
    expected = ref.avg_voxelize(features.numpy(), coords.numpy(), R)
    np.testing.assert_allclose(voxels.numpy(), expected, rtol=1e-6, atol=1e-7)
    # the boundaries: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2; 3.0 (R - 1) -> 3; empty voxels stay 0
    one = torch.tensor([[[2.0, 4.0, 9.0]]])
    at = torch.tensor([[[0.5, 0.0, 3.0], [1.5, 2.0, 3.0], [2.5, 2.4, 3.0]]])
    out, _ = forward_backward(ops.avg_voxelize, one, (at, R))
    assert out[0, 0, 0, 2, 2] == 3.0 and out[0, 0, 3, 3, 3] == 9.0
    assert out.abs().sum() == 12.0  # 62 empty voxels are 0


def check_trilinear_devoxelize() -> None:
    grid = torch.randn(B, C, R, R, R, generator=gen(5))
    coords = grid_coords()
    out = compare(ops.trilinear_devoxelize, grid.double(), (coords.double(), R), rtol=1e-12)
    out = compare(ops.trilinear_devoxelize, grid, (coords, R), rtol=1e-6)
    expected = ref.trilinear_devoxelize(grid.numpy(), coords.numpy(), R)
    assert np.array_equal(out.numpy(), expected)
    # a grid point reads only its voxel, the last one (R - 1 on every axis) included: every
    # other voxel is inf, so a corner read with weight 0 would make the result nan (0 * inf)
    grid = torch.full((1, 1, R, R, R), float("inf"))
    grid[0, 0, 1, 2, 0], grid[0, 0, R - 1, R - 1, R - 1] = 5.0, 7.0
    at = torch.tensor([[[1.0, R - 1.0], [2.0, R - 1.0], [0.0, R - 1.0]]])
    out, _ = forward_backward(ops.trilinear_devoxelize, grid, (at, R))
    assert out.tolist() == [[[5.0, 7.0]]]


def check_interpolate() -> None:
    points = torch.randn(B, 3, N, generator=gen(6))
    centers = torch.randn(B, 3, 12, generator=gen(7))
    features = torch.randn(B, C, 12, generator=gen(8))
    values, index, weights = ref.three_nn_interpolate(
        points.numpy(), centers.numpy(), features.numpy()
    )
    index, weights = torch.from_numpy(index), torch.from_numpy(weights)
    out = compare(ops.interpolate, features, (index, weights), rtol=1e-6)
    assert np.array_equal(out.numpy(), values)
    compare(ops.interpolate, features.double(), (index, weights.double()), rtol=1e-12)


def check_half_precision_accumulates_in_float32() -> None:
    """Autocast hands half-precision features to every op (and float32 coordinates and weights):
    outputs have the plain path's dtype, and equal the kernels on float32 copies rounded once,
    so the sums ran in float32."""
    coords = grid_coords()
    index = torch.randint(0, N, (B, 30, 5), generator=gen(9))
    nn_index = torch.randint(0, 12, (B, 3, N), generator=gen(10))
    weights = torch.rand(B, 3, N, generator=gen(11))
    cases = [
        (ops.grouping, torch.randn(B, C, N, generator=gen(12)), (index,)),
        (ops.avg_voxelize, torch.randn(B, C, N, generator=gen(13)), (coords, R)),
        (ops.trilinear_devoxelize, torch.randn(B, C, R, R, R, generator=gen(14)), (coords, R)),
        (ops.interpolate, torch.randn(B, C, 12, generator=gen(15)), (nn_index, weights)),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for op, x, rest in cases:
            x = x.to(dtype)
            shape_like = op(x, *rest)
            grad = torch.randn(shape_like.shape, generator=gen(16)).to(shape_like.dtype)
            out, dx = forward_backward(op, x, rest, grad)
            wide, dx_wide = forward_backward(op, x.float(), rest, grad.float())
            with torch_path():
                plain = op(x, *rest)
            name = f"{op.__name__} {dtype}"
            assert out.dtype == plain.dtype and dx.dtype == dtype, name
            assert torch.equal(out, wide.to(out.dtype)), name
            assert torch.equal(dx, dx_wide.to(dtype)), name


CHECKS = [
    check_grouping,
    check_avg_voxelize,
    check_trilinear_devoxelize,
    check_interpolate,
    check_half_precision_accumulates_in_float32,
]


def main() -> None:
    from recipes.pointcloud import gpu_scatter

    if type(gpu_scatter._grouping_fwd).__name__ != "InterpretedFunction":
        raise SystemExit("run with TRITON_INTERPRET=1 (the kernels are compiled, not interpreted)")
    if os.environ.get("POINTCLOUD_KERNELS") != "triton":
        raise SystemExit("run with POINTCLOUD_KERNELS=triton")
    for check in CHECKS:
        start, error = time.perf_counter(), None
        try:
            check()
        except Exception:
            error = traceback.format_exc()
        seconds = round(time.perf_counter() - start, 2)
        print(json.dumps({"check": check.__name__, "seconds": seconds, "error": error}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
