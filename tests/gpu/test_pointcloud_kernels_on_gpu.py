"""pcdiff's own CUDA kernels against the recipe's PyTorch ops and network, on a GPU.

Needs the original's code, which is not part of this project: PCDIFF_SRC=<a checkout of
DimensionLab/pcdiff-implant at 115a399>/pcdiff, and the CUDA toolkit (nvcc) for torch's JIT build,
which the original's own loader runs (modules/functional/backend.py: _load_cuda_backend). Each
test is skipped, saying which is missing, without them.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from recipes.pointcloud.model import PVCNN2
from tests.recipes.pointcloud.test_original import FIXTURES, RECORD
from tests.reference.pointcloud_kernels import (
    FLOAT_TOLERANCE,
    compare_ops,
    load_pcdiff,
    original_pvcnn2,
)
from tests.reference.pointcloud_reference import fill_weights

# (batch, points, centres, radius, neighbours, voxel resolution, channels): the CPU default's
# first stage (512 points, radius 0.1 x 4, 32 neighbours, 16^3) and the original's (30720
# points, 10240 centres, radius 0.1, 128 neighbours, 32^3)
SIZES = {
    "cpu-default": dict(batch=4, points=512, centers=170, radius=0.4, neighbors=32, resolution=16),
    "original": dict(
        batch=2, points=30720, centers=10240, radius=0.1, neighbors=128, resolution=32
    ),
}


@pytest.fixture(scope="module")
def pcdiff_backend():
    """The original's modules.functional.backend with its compiled CUDA kernels installed."""
    backend, reason = load_pcdiff(os.environ.get("PCDIFF_SRC"))
    if backend is None:
        pytest.skip(reason)
    return backend


@pytest.mark.parametrize("size", SIZES)
def test_the_ops_match_the_originals_cuda_kernels(pcdiff_backend, size, record):
    measured = compare_ops(pcdiff_backend._real_backend, "cuda", channels=16, **SIZES[size])
    record(size=size, **measured)


def test_the_network_on_the_gpu_equals_the_original_on_its_kernels(pcdiff_backend, record):
    """The same weights and input through the original's PVCNN2 on its kernels and through
    the recipe's on its ops, both on the GPU in fp32 (TF32 off): within 1e-5 relative."""
    config = dict(RECORD["small"]["config"])
    theirs = original_pvcnn2(config).cuda().eval()
    config.pop("num_nn")
    ours = PVCNN2(**config).cuda().eval()
    weights = fill_weights(ours.state_dict())
    ours.load_state_dict(weights, strict=True)
    theirs.load_state_dict(weights, strict=True)
    fixture = load_file(str(FIXTURES / "pvcnn2_forward.safetensors"))
    inputs, t = fixture["inputs"].cuda(), fixture["t"].cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            expected, output = theirs(inputs, t), ours(inputs, t)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    scale = expected.abs().max()
    difference = ((output - expected).abs().max() / scale).item()
    from_cpu = ((expected.cpu() - fixture["output"]).abs().max() / scale).item()
    record(ours_vs_original_on_gpu=difference, original_gpu_vs_cpu_fixture=from_cpu)
    assert difference <= FLOAT_TOLERANCE, difference
