"""Which implementation of the point ops runs: Triton kernels on CUDA tensors, plain PyTorch
elsewhere. The plain-PyTorch ops launch many small kernels per call on a GPU (farthest-point
sampling: several per centre), which is where the recipe lost to pcdiff's CUDA kernels.

`POINTCLOUD_KERNELS` overrides the choice: `torch` forces plain PyTorch (to compare on a GPU),
`triton` forces the Triton kernels on any device; with `TRITON_INTERPRET=1` they then run on the
CPU, which is how the CPU suite tests them against the brute-force references."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

CHOICES = ("auto", "torch", "triton")


# looked up once at import (a cached function in the ops' path would be a Dynamo warning)
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def kernels_choice() -> str:
    """The `POINTCLOUD_KERNELS` setting; an unknown value stops with one line."""
    choice = os.environ.get("POINTCLOUD_KERNELS", "auto")
    if choice not in CHOICES:
        raise SystemExit(f"POINTCLOUD_KERNELS={choice!r}: use one of {', '.join(CHOICES)}")
    if choice == "triton" and not TRITON_AVAILABLE:
        raise SystemExit("POINTCLOUD_KERNELS=triton, but triton is not installed")
    return choice


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether an op on `tensor` runs the Triton kernels."""
    choice = kernels_choice()
    if choice == "auto":
        return tensor.is_cuda and TRITON_AVAILABLE
    return choice == "triton"


def launchable(kernel: Any) -> Any:
    """`torch.library.wrap_triton(kernel)`, so that torch.compile traces the launch; under
    Triton's interpreter (`TRITON_INTERPRET=1`, the CPU tests) torch 2.11 refuses interpreted
    kernels there, and the kernel itself runs (eagerly: the interpreter compiles nothing)."""
    try:
        return torch.library.wrap_triton(kernel)
    except RuntimeError:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise
        return kernel
