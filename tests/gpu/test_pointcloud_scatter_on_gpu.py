"""The Triton gather / scatter kernels (recipes/pointcloud/gpu_scatter.py) compiled for a GPU,
against ops.py's plain-PyTorch path on the same GPU, at the original's first-stage sizes.

The CPU suite checks them under Triton's interpreter (tests/recipes/pointcloud/
test_triton_scatter.py), where atomics sum in a fixed order and nothing is fused; here they sum
in arrival order and multiply-adds may be fused, so float32 results agree to FLOAT_TOLERANCE
relative to their largest magnitude, the tolerance the CUDA kernels of pcdiff are held to.
Half-precision inputs are compared with the torch ops on float32 copies, rounded once: the
kernels sum in float32, so they differ from that by at most one unit in the last place."""

from __future__ import annotations

import pytest
import torch

from recipes.pointcloud import ops
from tests.reference.pointcloud_kernels import FLOAT_TOLERANCE, relative_difference

B, C, N, M, K, R = 2, 64, 30720, 10240, 32, 32


def run(op, x: torch.Tensor, rest: tuple, grad: torch.Tensor, kernels: str, monkeypatch):
    monkeypatch.setenv("POINTCLOUD_KERNELS", kernels)
    x = x.detach().clone().requires_grad_()
    out = op(x, *rest)
    assert ("pointcloud" in type(out.grad_fn).__name__) == (kernels == "triton")
    out.backward(grad.to(out.dtype))
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name", ["grouping", "avg_voxelize", "trilinear_devoxelize", "interpolate"]
)
def test_the_kernels_match_the_torch_ops_on_the_gpu(name, dtype, monkeypatch, record):
    g = torch.Generator().manual_seed(0)
    grid_coords = ops.normalize_voxel_coords(torch.randn(B, 3, N, generator=g), R)
    cases = {
        "grouping": (
            torch.randn(B, C, N, generator=g),
            (torch.randint(0, N, (B, M, K), generator=g),),
        ),
        "avg_voxelize": (torch.randn(B, C, N, generator=g), (grid_coords, R)),
        "trilinear_devoxelize": (torch.randn(B, C, R, R, R, generator=g), (grid_coords, R)),
        "interpolate": (
            torch.randn(B, C, M, generator=g),
            (torch.randint(0, M, (B, 3, N), generator=g), torch.rand(B, 3, N, generator=g)),
        ),
    }
    x, rest = cases[name]
    rest = tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in rest)
    x = x.cuda().to(dtype)
    probe = getattr(ops, name)(x, *rest)
    grad = torch.randn(probe.shape, generator=g).cuda().to(probe.dtype).float()  # exact in both
    out, dx = run(getattr(ops, name), x, rest, grad, "triton", monkeypatch)
    expected, dx_expected = run(getattr(ops, name), x.float(), rest, grad, "torch", monkeypatch)
    expected, dx_expected = expected.to(out.dtype), dx_expected.to(dtype)
    assert dx.dtype == dtype
    forward, backward = relative_difference(out, expected), relative_difference(dx, dx_expected)
    record(op=name, dtype=str(dtype), forward=forward, backward=backward)
    ulp = 2.0**-7  # bfloat16's unit in the last place, relative
    assert forward <= (FLOAT_TOLERANCE if out.dtype == torch.float32 else ulp), forward
    assert backward <= (FLOAT_TOLERANCE if dtype == torch.float32 else ulp), backward
